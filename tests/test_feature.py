"""The feature draft (EAGLE-3) in the sampler: exact like any draft, and drafting exactly what it was trained to.

1. The loop's draft distributions equal an independent computation: `FeatureDraft.unroll` (the training-time test,
   one masked pass per step, no cache) on the verified prefix and the drafts so far. So the sampler runs the draft
   as it is trained, and cache rollback, re-feeding with the target's features and holes are right.
2. Exact enumeration of the induced sequence distribution and a chi-square test of 1e5 draws from the real loop
   against the target, with a planted bug caught; a one-token prompt (first loop drafts nothing) included.
3. Bad pairs are refused naming both sides.
"""

from collections import defaultdict

import pytest
import torch
from conftest import tiny_llama
from helpers import pvalue, sample_counts
from test_exactness import Dist, speculative_sequences, target_sequences, tv

import draftsmith.sampling.rejection as rejection
import draftsmith.sampling.speculative as speculative
from draftsmith.sampling import autoregressive_generate, speculative_generate
from draftsmith.sampling.feature import FeatureConfig, FeatureDraft, FeatureTap
from draftsmith.sampling.probs import SamplingConfig, process_logits

V = 5


def feature_draft(target, seed=1, scale=6.0, vocab=None):
    torch.manual_seed(seed)
    d = FeatureDraft(FeatureConfig.for_target(target.config, draft_vocab_size=None if vocab is None else len(vocab)))
    if vocab is not None:
        d.set_vocab(torch.tensor(vocab))
    with torch.no_grad():
        d.lm_head.weight.mul_(scale)
        d.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
    return d.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(vocab=V, layers=3, seed=0, logit_scale=8.0)
    return target, feature_draft(target)


class FeatureDist:
    """p(verified, drafts): the draft's processed distribution for the next draft token, via `unroll`."""

    def __init__(self, target, draft, cfg):
        self.target, self.draft, self.cfg = target, draft, cfg

    @torch.no_grad()
    def __call__(self, verified, drafts):
        e = len(verified) - 2  # last slot fed with the target's features
        with FeatureTap(self.target, self.draft.feature_layers) as tap:
            self.target(input_ids=torch.tensor([verified[:-1]]))
            feats = tap.take()
        tokens = verified[1:] + list(drafts)
        feats = torch.cat([feats, feats.new_zeros(1, len(drafts), feats.shape[-1])], 1)  # never attended
        outs = self.draft.unroll(torch.tensor([tokens]), feats, steps=len(drafts) + 1)
        out = self.draft.head(outs[len(drafts)][:, e + len(drafts)][:, None])
        logits = out.logits[0, -1]
        return process_logits(logits, self.cfg).double()


def loop_matches_unroll(target, draft, monkeypatch, temperature: float, prompt: list[int],
                        max_new_tokens: int) -> tuple[int, int]:
    """Speculative sampling with a spy on `verify`: every p the sampler verifies is asserted equal to the
    training-time-test computation (FeatureDist) on the same context. Returns (verify calls, calls that rejected)."""
    seen = []
    real = speculative.verify

    def spy(p, q, drafts, generator=None):
        n, nxt = real(p, q, drafts, generator)
        seen.append((p[0].clone(), drafts[0].tolist(), int(n[0]), int(nxt[0])))
        return n, nxt

    monkeypatch.setattr(speculative, "verify", spy)
    speculative_generate(target, draft, torch.tensor([prompt]), max_new_tokens=max_new_tokens, k=3,
                         temperature=temperature, generator=torch.Generator().manual_seed(3))
    ref, verified, rejected = FeatureDist(target, draft, SamplingConfig(temperature)), list(prompt), 0
    for p, drafts, n, nxt in seen:
        for i in range(len(drafts)):
            assert torch.allclose(p[i].double(), ref(verified, drafts[:i]), atol=1e-5)
        verified += drafts[:n] + [nxt]
        rejected += n < len(drafts)
    return len(seen), rejected


@pytest.mark.parametrize("temperature", [0.9, 1.3])
def test_loop_drafts_what_unroll_computes(pair, monkeypatch, temperature):
    """Every p the sampler verifies equals the training-time-test computation on the same context. (Greedy
    decoding builds no p; it is covered by the greedy-equality tests.)"""
    calls, rejected = loop_matches_unroll(*pair, monkeypatch, temperature, [1, 3, 2], 14)
    assert calls >= 4 and 0 < rejected < calls


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("setting", [(1.0, 0, 1.0), (0.8, 2, 0.9), (0.0, 0, 1.0)], ids=["T1", "T0.8-k2-p0.9", "greedy"])
@pytest.mark.parametrize("prompt", [[1, 3], [2]], ids=["prompt2", "prompt1"])
def test_exact_enumeration_feature_draft(pair, k, setting, prompt):
    target, draft = pair
    cfg = SamplingConfig(*setting)
    q, p = Dist(target, cfg), FeatureDist(target, draft, cfg)
    want = target_sequences(q, prompt, 3, 0)
    got = speculative_sequences(p, q, prompt, 3, k, 0, feature=True)
    assert abs(sum(got.values()) - 1) < 1e-6
    assert tv(got, want) < 1e-6


@pytest.mark.parametrize("k,setting,prompt", [(3, (1.0, 0, 1.0), [1, 3]), (2, (0.8, 0, 0.9), [2]),
                                              (3, (1.2, 3, 1.0), [4, 0, 1])])
def test_feature_draft_passes_chi_square(pair, k, setting, prompt):
    target, draft = pair
    budget = 3
    exact = target_sequences(Dist(target, SamplingConfig(*setting)), prompt, budget, 0)
    g = torch.Generator().manual_seed(1234)
    counts = defaultdict(int)
    for _ in range(4):
        c, stats = sample_counts(
            lambda ids: speculative_generate(target, draft, ids, max_new_tokens=budget, k=k, temperature=setting[0],
                                             top_k=setting[1], top_p=setting[2], eos_token_id=0, generator=g),
            25_000, budget, prompt)
        for s, n in c.items():
            counts[s] += n
    assert 0.0 < stats.alpha < 1.0
    assert pvalue(counts, exact) > 1e-3


def test_feature_draft_stays_exact_with_compacted_caches(pair, monkeypatch):
    """Holes compacted after every loop that leaves any: the feature draft's cache too (its one layer)."""
    import draftsmith.sampling.speculative as spec
    from draftsmith import sampling
    from draftsmith.sampling.cache import PreallocatedLayer

    target, draft = pair
    compacted = []
    real = sampling.cache.compact_cache
    monkeypatch.setattr(spec, "HOLE_LOOPS", 0)
    monkeypatch.setattr(sampling.cache, "compact_cache", lambda c, v, n: compacted.append(type(c)) or real(c, v, n))
    exact = target_sequences(Dist(target, SamplingConfig(0.9)), [1, 3], 4, None)
    g = torch.Generator().manual_seed(21)
    counts, stats = sample_counts(lambda ids: speculative_generate(target, draft, ids, max_new_tokens=4, k=2,
                                                                   temperature=0.9, generator=g), 50_000, 4, [1, 3])
    assert PreallocatedLayer in compacted and 0 < stats.alpha < 1
    assert pvalue(counts, exact) > 1e-3


def test_feature_chi_square_detects_a_planted_bug(pair, monkeypatch):
    target, draft = pair
    exact = target_sequences(Dist(target, SamplingConfig()), [1, 3], 3, None)
    monkeypatch.setattr(rejection, "residual", lambda p, q: q)
    g = torch.Generator().manual_seed(1234)
    counts, _ = sample_counts(lambda ids: speculative_generate(target, draft, ids, max_new_tokens=3, k=3, generator=g),
                              50_000, 3, [1, 3])
    assert pvalue(counts, exact) < 1e-6


def test_pruned_feature_head_batched_padded_greedy(monkeypatch):
    """A head over a token subset, batch > 1 with left padding and EOS: greedy equals the target's greedy, and
    sampling keeps drafted tokens inside the subset."""
    target = tiny_llama(vocab=40, layers=4, hidden=32, seed=2, logit_scale=4.0)
    draft = feature_draft(target, vocab=list(range(0, 40, 2)), scale=4.0)
    ids = torch.randint(0, 40, (4, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, :5] = 0
    want = autoregressive_generate(target, ids, attention_mask=mask, max_new_tokens=16, temperature=0, eos_token_id=5)
    got = speculative_generate(target, draft, ids, attention_mask=mask, max_new_tokens=16, k=3, temperature=0,
                               eos_token_id=5)
    assert [t.tolist() for t in got.tokens] == [t.tolist() for t in want.tokens]
    auto = speculative_generate(target, draft, ids, attention_mask=mask, max_new_tokens=16, k="auto", k_max=4,
                                cost={"c": 0.05, "v": {k: 1.0 for k in range(1, 5)}}, temperature=0, eos_token_id=5)
    assert [t.tolist() for t in auto.tokens] == [t.tolist() for t in want.tokens]
    assert len(set(auto.stats.k_per_loop)) > 1  # k="auto" ends some loops early: the head's K varies
    seen = []
    real = speculative.verify
    monkeypatch.setattr(speculative, "verify", lambda p, q, d, g=None: (seen.append(d.clone()), real(p, q, d, g))[1])
    speculative_generate(target, draft, ids, attention_mask=mask, max_new_tokens=16, k=3, temperature=1.0,
                         generator=torch.Generator().manual_seed(0))
    assert seen and all(bool((d % 2 == 0).all()) for d in seen)


def test_feature_draft_refuses_another_target(pair):
    _, draft = pair
    other = tiny_llama(vocab=V, layers=5, seed=0)
    with pytest.raises(ValueError, match=r"3 layers.*5 layers"):
        speculative_generate(other, draft, torch.tensor([[1, 2]]), max_new_tokens=2)
    with pytest.raises(ValueError, match="feature_layers must be 3 distinct layer ids"):
        FeatureConfig.for_target(other.config, feature_layers=[0, 2, 9])


def test_feature_layers_are_kept_in_the_order_vllm_passes_them(pair, tmp_path):
    """vLLM hands the draft the target's states in layer order, each layer once: a draft is built on its layers
    sorted, and one whose config names them otherwise (or a layer twice) is refused, not served wrong."""
    import dataclasses
    import json

    target, draft = pair
    assert FeatureConfig.for_target(target.config, feature_layers=[2, 0, 1]).feature_layers == [0, 1, 2]
    with pytest.raises(ValueError, match="3 distinct layer ids"):
        FeatureConfig.for_target(target.config, feature_layers=[0, 0, 1])
    with pytest.raises(ValueError, match=r"in \[0, 2\), got \[0, 1, 1\]"):  # too shallow for 3 distinct layers
        FeatureConfig.for_target(tiny_llama(vocab=V, layers=2).config)
    with pytest.raises(ValueError, match=r"\[2, 0, 1\] are not in increasing order"):
        dataclasses.replace(draft.config, feature_layers=[2, 0, 1])
    draft.save_pretrained(tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    (tmp_path / "d" / "config.json").write_text(json.dumps({**cfg, "feature_layers": [0, 2, 2]}))
    with pytest.raises(ValueError, match=r"3 distinct layer ids of the target in \[0, 3\), got \[0, 2, 2\]"):
        FeatureDraft.from_pretrained(tmp_path / "d")


def test_save_load_roundtrip(pair, tmp_path):
    target, draft = pair
    draft.save_pretrained(tmp_path / "d")
    again = FeatureDraft.from_pretrained(tmp_path / "d")
    # the layer ids where vLLM reads them (top level): a draft trained on other layers than vLLM's defaults must
    # not be served with those (SGLang's copy: test_sglang_reads_the_layers_the_head_was_trained_on)
    import json

    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == list(draft.feature_layers)
    ids = torch.tensor([[1, 3, 2, 4]])
    a = speculative_generate(target, draft, ids, max_new_tokens=6, temperature=0)
    b = speculative_generate(target, again, ids, max_new_tokens=6, temperature=0)
    assert a.tokens[0].tolist() == b.tokens[0].tolist()
    (tmp_path / "d" / "model.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(ValueError, match="not a readable feature draft"):
        FeatureDraft.from_pretrained(tmp_path / "d")


def sglang_captures(ids: list[int]) -> list[int]:
    """The target layer whose entering state SGLang feeds the head for `eagle_config` ids: id + 1, as
    `LlamaForCausalLM.set_eagle3_layers_to_capture` in sglang 0.5.23 sets them (its Qwen models alike)."""
    return [i + 1 for i in ids]


@pytest.mark.parametrize("layers", [None, [0, 14, 29], [1, 14, 27], [5, 14, 27]])
def test_sglang_reads_the_layers_the_head_was_trained_on(tmp_path, layers):
    """SGLang (and SpecForge, which writes its configs) numbers layer outputs, one below ours: the head's
    `eagle_config` ids are captured by SGLang where it was trained, the embedding (our 0) included, and EAGLE-3's
    default head on a 30-layer target is written as SpecForge's own default [1, L//2-1, L-4], which our SpecForge
    loader reads back as trained."""
    import json

    from transformers import LlamaConfig

    from draftsmith.sampling.feature import FeatureConfig
    from draftsmith.sampling.peers import load_feature

    tc = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                     num_key_value_heads=2, num_hidden_layers=30)
    draft = FeatureDraft(FeatureConfig.for_target(tc, feature_layers=layers))
    draft.save_pretrained(tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    nested = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert sglang_captures(nested) == draft.feature_layers
    if layers is None:
        assert nested == [1, 30 // 2 - 1, 30 - 4]
    specforge = {k: v for k, v in cfg.items() if k not in ("draftsmith_kind", "feature_layers",
                                                             "eagle_aux_hidden_state_layer_ids")}
    (tmp_path / "d" / "config.json").write_text(json.dumps(specforge))
    assert load_feature(tmp_path / "d").feature_layers == draft.feature_layers
