"""The preallocated KV cache (sampling/cache.py) holds exactly what transformers' DynamicCache holds, through the
sampler's whole life cycle: prefill, steps, rollback, finished rows dropped, growth past the announced length."""

import torch
from conftest import tiny_llama
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from draftsmith.sampling.cache import PreallocatedLayer, preallocated_cache


def test_layer_matches_dynamic_through_updates_crops_selects_and_growth():
    g = torch.Generator().manual_seed(0)
    ref, mine = DynamicLayer(), PreallocatedLayer(capacity=6)
    kv = lambda b, n: (torch.randn(b, 2, n, 4, generator=g), torch.randn(b, 2, n, 4, generator=g))  # noqa: E731
    for op in [("add", 5), ("add", 1), ("crop", -2), ("add", 3), ("select", [2, 0]), ("add", 9), ("crop", -4),
               ("add", 1)]:
        if op[0] == "add":
            b = ref.keys.shape[0] if ref.is_initialized else 3
            k, v = kv(b, op[1])
            out_ref, out = ref.update(k, v), mine.update(k, v)
            assert all(torch.equal(a, b) for a, b in zip(out_ref, out))
        elif op[0] == "crop":
            ref.crop(op[1]), mine.crop(op[1])
        else:
            idx = torch.tensor(op[1])
            ref.batch_select_indices(idx), mine.batch_select_indices(idx)
        assert mine.get_seq_length() == ref.get_seq_length()
        assert torch.equal(mine.keys, ref.keys) and torch.equal(mine.values, ref.values)
    assert mine._k.shape[2] >= 14  # grew past the announced 6 (doubling), once, not per token


def test_model_logits_equal_dynamic_cache_step_by_step():
    model = tiny_llama(vocab=16, layers=2, hidden=32)
    ids = torch.randint(0, 16, (2, 12), generator=torch.Generator().manual_seed(1))
    dyn, pre = DynamicCache(config=model.config), preallocated_cache(model.config, capacity=8)
    assert all(isinstance(layer, PreallocatedLayer) for layer in pre.layers)
    for start, end in [(0, 5), (5, 6), (6, 9), (9, 12)]:
        pos = torch.arange(start, end)[None].expand(2, -1)
        a = model(input_ids=ids[:, start:end], position_ids=pos, cache=dyn, use_cache=True).logits
        b = model(input_ids=ids[:, start:end], position_ids=pos, cache=pre, use_cache=True).logits
        assert torch.allclose(a, b, atol=1e-6)


def test_compaction_keeps_each_rows_valid_slots_in_order():
    """compact_cache on a preallocated cache and a feature draft's one-layer cache: each row's valid keys and values
    come out first, in their order, and the new mask is left-aligned; a plain DynamicCache is left as it is."""
    from draftsmith.sampling.cache import PreallocatedLayer, compact_cache

    g = torch.Generator().manual_seed(0)
    valid = torch.tensor([[1, 0, 1, 1, 0, 1, 0], [0, 0, 1, 0, 1, 0, 0], [1, 1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    k, v = torch.randn(3, 2, 7, 4, generator=g), torch.randn(3, 2, 7, 4, generator=g)
    config = tiny_llama(vocab=16, layers=2, hidden=32).config
    assert compact_cache(DynamicCache(config=config), valid, 6) is None
    caches = [preallocated_cache(config, capacity=9), PreallocatedLayer(4)]  # the feature draft's; grows
    for cache in caches:
        layers = getattr(cache, "layers", None)
        for layer in layers or [cache]:
            layer.update(k.clone(), v.clone())
        new = compact_cache(cache, valid, 6)
        assert new.tolist() == [[1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]]
        for layer in layers or [cache]:
            keys, values = layer.keys, layer.values
            assert keys.shape[2] == 6
            for r in range(3):
                n = int(valid[r].sum())
                assert torch.equal(keys[r, :, :n], k[r][:, valid[r]])
                assert torch.equal(values[r, :, :n], v[r][:, valid[r]])


def test_model_logits_survive_compaction_of_holes():
    """A model over a cache with masked holes gives the same logits before and after its holes are compacted."""
    from draftsmith.sampling.cache import Decoder

    model = tiny_llama(vocab=16, layers=2, hidden=32)
    ids = torch.randint(0, 16, (2, 12), generator=torch.Generator().manual_seed(1))
    plain, packed = Decoder(model, capacity=40), Decoder(model, capacity=40, holes=0)
    ones = lambda n: torch.ones(2, n, dtype=torch.bool)  # noqa: E731
    pos = torch.arange(5)[None].expand(2, -1)
    for dec in (plain, packed):
        dec(ids[:, :5], pos, ones(5), 1)
    nxt = torch.tensor([5, 5])
    for step, accepted in enumerate([[2, 0], [0, 3], [3, 0], [0, 2]]):  # rows keep a prefix of the 4 new slots
        block = ids[:, 5 + step: 9 + step]
        outs = [dec(block, nxt[:, None] + torch.arange(4), ones(4), 4).logits for dec in (plain, packed)]
        assert torch.allclose(outs[0], outs[1], atol=1e-5)
        keep = torch.arange(4)[None] <= torch.tensor(accepted)[:, None]
        for dec in (plain, packed):
            dec.settle(keep, keep)  # on a CPU the device's mask is the host's
        nxt = nxt + torch.tensor(accepted) + 1
    assert packed.compactions >= 2 and plain.compactions == 0
    assert packed.valid.shape[1] < plain.valid.shape[1]
    assert bool(packed.valid[:, : int(packed.valid.sum(1).min())].all())


def test_a_batched_prefill_keeps_its_last_logits_through_a_contiguous_gather():
    # a slice of the last positions of a batch > 1 is a non-contiguous view, over which a linear head copies its
    # weight once per row (7 s for the demo's head at batch 64, bf16): the Decoder hands the models an index
    from draftsmith.sampling.cache import Decoder, keep_index, keep_last
    from draftsmith.sampling.pruned import PrunedHeadDraft

    h = torch.randn(3, 7, 5)
    for k in (1, 2):
        got = keep_last(h, k)
        assert got.is_contiguous() and torch.equal(got, h[:, -k:])
        assert torch.equal(keep_last(h, keep_index(k, 7)), h[:, -k:])
    assert keep_index(0, 7) == 0 and keep_index(7, 7) == 7 and keep_index(None, 7) is None

    model = tiny_llama(vocab=16, layers=2, hidden=32)
    pruned = PrunedHeadDraft(model, torch.tensor([0, 3, 5, 9, 15]))
    ids = torch.randint(0, 16, (3, 6), generator=torch.Generator().manual_seed(2))
    pos, valid = torch.arange(6).expand(3, -1), torch.ones(3, 6, dtype=torch.bool)
    with torch.no_grad():
        full, sub = model(input_ids=ids).logits, pruned(input_ids=ids).sub_logits
        for m, ref in ((model, full), (pruned, sub)):
            out = Decoder(m, capacity=8)(ids, pos, valid, 2)
            got = out.sub_logits if m is pruned else out.logits
            assert got.shape == (3, 2, ref.shape[-1]) and torch.allclose(got, ref[:, -2:], atol=1e-5)
