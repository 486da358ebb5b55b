"""The loop's behaviour: forced acceptance patterns, greedy equality, caches, stops, stats, bad input."""

from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_llama
from transformers import LlamaConfig

from draftsmith.sampling import autoregressive_generate, speculative_generate


class MarkovStub(torch.nn.Module):
    """A stub causal LM whose next-token logits depend on the current token only: table[token] -> (V,)."""

    def __init__(self, table):
        super().__init__()
        self.table = torch.as_tensor(table, dtype=torch.float32).log()
        V = self.table.shape[0]
        self.config = LlamaConfig(vocab_size=V, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
                                  max_position_embeddings=1024)
        self.calls = []

    def get_output_embeddings(self):
        return SimpleNamespace(weight=torch.empty(self.table.shape[0], 1))

    def forward(self, input_ids, logits_to_keep=0, **_):
        self.calls.append(input_ids.shape[1])
        logits = self.table[input_ids]
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)


def rows(V, row):
    return [row] * V


def test_target_never_accepts_draft_tokens():
    draft = MarkovStub(rows(4, [1.0, 0, 0, 0]))  # always proposes token 0
    target = MarkovStub(rows(4, [0, 0.5, 0.5, 0]))  # never emits token 0
    out = speculative_generate(target, draft, torch.tensor([[1]]), max_new_tokens=20, k=4,
                               generator=torch.Generator().manual_seed(0))
    s = out.stats
    assert s.alpha == 0 and s.tokens_per_call == 1 and s.target_calls == 20
    assert set(out.tokens[0].tolist()) <= {1, 2}
    assert s.acceptance_by_position[0] == 0 and s.tested_at[1:] == [0, 0, 0]


def test_target_always_accepts_draft_tokens():
    table = rows(4, [0.1, 0.2, 0.3, 0.4])
    out = speculative_generate(MarkovStub(table), MarkovStub(table), torch.tensor([[1, 2]]), max_new_tokens=20, k=4,
                               generator=torch.Generator().manual_seed(0))
    s = out.stats
    assert s.alpha == 1 and s.alpha_analytic == pytest.approx(1.0)
    assert s.tokens_per_call == 5 and s.target_calls == 4  # K+1 tokens per target pass
    assert len(out.tokens[0]) == 20


def test_target_sometimes_accepts_draft_tokens():
    """q(0) = 0.3 and the draft always proposes 0: each test accepts with probability exactly 0.3."""
    draft = MarkovStub(rows(3, [1.0, 0, 0]))
    target = MarkovStub(rows(3, [0.3, 0.7, 0]))
    ids = torch.ones(2000, 1, dtype=torch.long)
    out = speculative_generate(target, draft, ids, max_new_tokens=8, k=3, generator=torch.Generator().manual_seed(0))
    s = out.stats
    assert abs(s.alpha - 0.3) < 0.02 and s.alpha_analytic == pytest.approx(0.3, abs=1e-6)
    assert abs(s.acceptance_by_position[0] - 0.3) < 0.03 and abs(s.acceptance_by_position[1] - 0.3) < 0.05
    # after a rejection the residual (q - p)+ puts all its mass on token 1
    assert s.tokens_per_call == pytest.approx(s.new_tokens / s.row_loops)
    assert 1 <= s.tokens_per_call <= 4


@pytest.mark.parametrize("k", [1, 2, 5])
def test_greedy_equals_target_greedy_with_batch_and_padding(k):
    """Rows accept different numbers of tokens (KV-cache holes), prompts of different lengths (left padding)."""
    target = tiny_llama(vocab=32, layers=2, hidden=32, seed=0, logit_scale=4.0)
    draft = tiny_llama(vocab=32, layers=1, hidden=16, seed=3, logit_scale=4.0)
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5], [0, 9, 9, 1, 2]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])
    spec = speculative_generate(target, draft, ids, attention_mask=mask, max_new_tokens=24, k=k, temperature=0)
    for b in range(3):
        alone = ids[b, mask[b].bool()][None]
        ref = autoregressive_generate(target, alone, max_new_tokens=24, temperature=0)
        assert spec.tokens[b].tolist() == ref.tokens[0].tolist()
    assert 0 < spec.stats.alpha < 1
    # also against transformers' own greedy decoding
    hf = target.generate(ids[1:2], max_new_tokens=24, do_sample=False, min_new_tokens=24)
    assert hf[0, 5:].tolist() == spec.tokens[1].tolist()


def test_caches_are_rolled_back_and_never_recompute():
    """The target sees the prompt once, then exactly one K+1-token block per loop; the draft one token per step
    (two when it owes the last draft token after a full acceptance)."""
    target = tiny_llama(vocab=16, seed=0, logit_scale=3.0)
    draft = tiny_llama(vocab=16, layers=1, hidden=16, seed=2, logit_scale=3.0)
    seen = {"target": [], "draft": []}
    for name, m in (("target", target), ("draft", draft)):
        m.register_forward_pre_hook(lambda mod, a, kw, name=name: seen[name].append(kw["input_ids"].shape[1]),
                                    with_kwargs=True)
    ids = torch.arange(1, 9)[None]
    out = speculative_generate(target, draft, ids, max_new_tokens=30, k=3, generator=torch.Generator().manual_seed(0))
    assert seen["target"][0] == 7 and seen["draft"][0] == 7  # the prompt minus its last token, once
    assert set(seen["target"][1:]) <= {2, 3, 4} and len(seen["target"]) - 1 == out.stats.target_calls
    assert set(seen["draft"][1:]) <= {1, 2}
    # the target processed each sequence position at most once, except rejected drafts (discarded)
    processed = sum(seen["target"])
    assert processed <= 7 + out.stats.target_calls * 4
    # and a fresh greedy run still agrees with plain decoding token for token (no stale cache slot)
    spec = speculative_generate(target, draft, ids, max_new_tokens=30, k=3, temperature=0)
    ref = autoregressive_generate(target, ids, max_new_tokens=30, temperature=0)
    assert spec.tokens[0].tolist() == ref.tokens[0].tolist()


def test_eos_and_max_new_tokens_stop_exactly():
    table = rows(4, [0.25, 0.25, 0.25, 0.25])
    g = torch.Generator().manual_seed(0)
    out = speculative_generate(MarkovStub(table), MarkovStub(table), torch.ones(300, 1, dtype=torch.long),
                               max_new_tokens=7, k=4, eos_token_id=3, generator=g)
    lengths = set()
    for t in out.tokens:
        t = t.tolist()
        assert 1 <= len(t) <= 7
        assert 3 not in t[:-1]  # nothing after EOS
        if len(t) < 7:
            assert t[-1] == 3
        lengths.add(len(t))
    assert len(lengths) > 3
    assert all(len(t) == 7 for t in speculative_generate(MarkovStub(table), MarkovStub(table), torch.ones(5, 1).long(),
                                                         max_new_tokens=7, k=4, generator=g).tokens)


def test_seeded_runs_are_reproducible():
    target, draft = tiny_llama(vocab=16, seed=0), tiny_llama(vocab=16, layers=1, seed=1)
    ids = torch.tensor([[1, 2, 3], [3, 2, 1]])
    a = speculative_generate(target, draft, ids, max_new_tokens=12, generator=torch.Generator().manual_seed(5))
    b = speculative_generate(target, draft, ids, max_new_tokens=12, generator=torch.Generator().manual_seed(5))
    assert [t.tolist() for t in a.tokens] == [t.tolist() for t in b.tokens]


def test_stats_are_consistent():
    target, draft = tiny_llama(vocab=16, seed=0), tiny_llama(vocab=16, layers=1, seed=1)
    out = speculative_generate(target, draft, torch.tensor([[1, 2, 3]]), max_new_tokens=40, k=4,
                               generator=torch.Generator().manual_seed(0))
    s = out.stats.to_dict()
    assert s["new_tokens"] == 40 and 1 <= s["tokens_per_call"] <= 5
    assert s["accepted"] == sum(s["accepted_at"]) and s["drafted"] == sum(s["tested_at"])
    assert 0 <= s["alpha_analytic"] <= 1 and s["acceptance_efficiency"] == pytest.approx(s["tokens_per_call"] / 5)
    assert s["draft_s"] > 0 and s["target_s"] > 0 and s["overhead_s"] >= 0
    assert s["draft_s"] + s["target_s"] + s["prefill_s"] <= s["total_s"]


@pytest.mark.parametrize("kwargs,msg", [
    (dict(k=0), "k"), (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(max_new_tokens=200), "context"), (dict(input_ids=torch.zeros(1, 0, dtype=torch.long)), "empty"),
])
def test_bad_input_is_refused_with_a_clear_error(kwargs, msg):
    target = tiny_llama(vocab=16, seed=0, max_positions=64)
    draft = tiny_llama(vocab=16, layers=1, seed=1, max_positions=64)
    args = dict(input_ids=torch.tensor([[1, 2]]), max_new_tokens=8) | kwargs
    with pytest.raises(ValueError, match=msg):
        speculative_generate(target, draft, **args)


def test_vocabulary_mismatch_is_refused():
    with pytest.raises(ValueError, match="vocabulary"):
        speculative_generate(tiny_llama(vocab=16), tiny_llama(vocab=17), torch.tensor([[1]]), max_new_tokens=4)


@pytest.mark.demo
def test_demo_target_greedy_is_identical_to_its_own_greedy(demo_target):
    """Temperature 0 on SmolLM2-135M (fp32): SpS output == the target's greedy decoding, token for token."""
    from draftsmith.sampling.load import load_model

    model, tok = demo_target
    draft = load_model("smollm2-135m", "fp32")
    draft.model.layers = draft.model.layers[:4]  # a truncated draft: accepted rarely, so rejections abound
    draft.config.num_hidden_layers = 4
    for prompt in ["def quicksort(xs):\n", "The capital of France is"]:
        ids = tok(prompt, return_tensors="pt").input_ids
        spec = speculative_generate(model, draft, ids, max_new_tokens=40, k=4, temperature=0,
                                    eos_token_id=tok.eos_token_id)
        hf = model.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=tok.eos_token_id)
        assert spec.tokens[0].tolist() == hf[0, ids.shape[1]:].tolist()
        assert spec.stats.accepted < spec.stats.drafted


@pytest.mark.parametrize("setting", [(1.0, 0, 1.0), (0.8, 0, 0.95), (0.7, 3, 1.0), (0.0, 0, 1.0), (1.0, 50, 0.5)])
def test_pruned_head_processed_over_its_subset_equals_the_padded_vocabulary(setting):
    from draftsmith.sampling.probs import SamplingConfig, process_logits
    from draftsmith.sampling.pruned import PrunedOutput
    from draftsmith.sampling.speculative import last_probs

    g = torch.Generator().manual_seed(0)
    ids = torch.randperm(300, generator=g)[:40].sort().values
    out = PrunedOutput(torch.randn(3, 1, 40, generator=g) * 3, ids, 300)
    cfg = SamplingConfig(*setting)
    torch.testing.assert_close(last_probs(out, cfg), process_logits(out.logits[:, -1], cfg))
