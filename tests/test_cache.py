"""The preallocated KV cache (sampling/cache.py) holds exactly what transformers' DynamicCache holds, through the
sampler's whole life cycle: prefill, steps, rollback, finished rows dropped, growth past the announced length."""

import torch
from conftest import tiny_llama
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from sampling.cache import PreallocatedLayer, preallocated_cache


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
