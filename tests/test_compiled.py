"""The compiled static-shape path (`compile=True`, sampling/compiled.py) is as exact as the eager one.

Each test compiles real inductor graphs (about 10-20 s a shape on 2 cores; the chi-square tests take 20-70 s),
so the statistical ones are marked slow and run in CI (`python -m pytest -m slow`).
"""

from collections import defaultdict

import pytest
import torch
from conftest import tiny_llama
from helpers import chi2_pvalue
from test_exactness import Dist, target_sequences

import sampling.compiled as compiled
import sampling.speculative as spec
from sampling import autoregressive_generate, speculative_generate
from sampling.probs import SamplingConfig
from sampling.pruned import PrunedHeadDraft

V = 5


@pytest.fixture(scope="module")
def pair():
    return tiny_llama(vocab=V, seed=0, logit_scale=8.0), tiny_llama(vocab=V, layers=1, hidden=16, seed=1,
                                                                    logit_scale=6.0)


def counts_of(gen):
    counts = defaultdict(int)
    for t in gen.tokens:
        counts[tuple(t.tolist())] += 1
    return counts


def pvalue(counts, exact):
    keys = sorted(set(exact) | set(counts))
    return chi2_pvalue([counts.get(s, 0) for s in keys], [exact.get(s, 0.0) for s in keys])


@pytest.mark.slow
def test_compiled_speculative_generate_passes_chi_square(pair, monkeypatch):
    """50k rows through compiled steps: holes compacted after every loop that leaves one, rows ending at EOS
    kept in the static batch unread; the output is still exactly the target's distribution."""
    target, draft = pair
    pruned = PrunedHeadDraft(draft, torch.tensor([0, 1, 2, 3]))
    compactions, calls = [], []
    monkeypatch.setattr(spec, "HOLE_LOOPS", 0)
    real_compact, real_compiled = compiled.StaticDecoder._compact, compiled.StaticDecoder._compiled
    monkeypatch.setattr(compiled.StaticDecoder, "_compact", lambda self: compactions.append(1) or real_compact(self))
    monkeypatch.setattr(compiled.StaticDecoder, "_compiled",
                        lambda self, *a: calls.append(self.model) or real_compiled(self, *a))
    prompt, budget, eos = [1, 3], 4, 0
    exact = target_sequences(Dist(target, SamplingConfig(0.9, 0, 1.0)), prompt, budget, eos)
    g = torch.Generator().manual_seed(77)
    gen = speculative_generate(target, pruned, torch.tensor([prompt]).repeat(50_000, 1), max_new_tokens=budget, k=1,
                               temperature=0.9, eos_token_id=eos, generator=g, compile=True)
    assert 0 < gen.stats.alpha < 1 and len(compactions) >= 4
    assert target in calls and pruned in calls  # both models ran their compiled steps
    assert any(len(t) < budget for t in gen.tokens)  # some rows ended early at EOS
    shapes = {(r["model"], r["tokens"]) for r in compiled.compile_report()}
    assert ("LlamaForCausalLM (2 layers)", 2) in shapes and ("PrunedHeadDraft (1 layers)", 1) in shapes
    assert pvalue(counts_of(gen), exact) > 1e-3


def test_compiled_steps_read_the_weights_as_they_are_now():
    """A draft validated between optimiser steps is updated in place: its compiled step must not have the old
    weights baked into its graph (inductor's freezing would)."""
    model = tiny_llama(vocab=V, layers=1, hidden=16, seed=3).requires_grad_(True)
    ids = torch.tensor([[1, 2, 3, 4]])

    def last_logits():
        dec = compiled.StaticDecoder(model, 8)
        dec(ids[:, :3], torch.arange(3)[None], torch.ones(1, 3, dtype=torch.bool), 1)  # prefill, eager
        return dec(ids[:, 3:], torch.tensor([[3]]), torch.ones(1, 1, dtype=torch.bool), 1).logits[0, -1]

    def eager():
        return model(ids).logits[0, -1]

    with torch.inference_mode():
        torch.testing.assert_close(last_logits(), eager(), rtol=1e-4, atol=1e-4)
        with torch.no_grad():
            model.lm_head.weight.mul_(-2.0)
        torch.testing.assert_close(last_logits(), eager(), rtol=1e-4, atol=1e-4)


def test_compile_refuses_a_feature_draft_before_any_work():
    from test_feature import feature_draft

    target = tiny_llama(vocab=V, layers=3, seed=0)
    with pytest.raises(ValueError, match="feature draft .* drop compile"):
        speculative_generate(target, feature_draft(target), torch.tensor([[1, 2]]), max_new_tokens=2, compile=True)


@pytest.mark.slow
def test_compiled_autoregressive_generate_passes_chi_square(pair):
    target, _ = pair
    exact = target_sequences(Dist(target, SamplingConfig(0.9, 0, 0.95)), [1, 3], 3, None)
    g = torch.Generator().manual_seed(7)
    gen = autoregressive_generate(target, torch.tensor([[1, 3]]).repeat(50_000, 1), max_new_tokens=3,
                                  temperature=0.9, top_p=0.95, generator=g, compile=True)
    assert pvalue(counts_of(gen), exact) > 1e-3


@pytest.mark.slow
@pytest.mark.demo
def test_demo_target_compiled_greedy_is_identical_to_its_greedy(demo_target):
    """Temperature 0 on SmolLM2-135M, compiled steps, a 4-layer cut draft (rejections abound): SpS == the
    target's own greedy decoding (transformers, eager), token for token."""
    from train.models import truncated_target

    model, tok = demo_target
    draft = truncated_target(model, 4).eval()
    ids = tok("def quicksort(xs):\n", return_tensors="pt").input_ids
    spec_gen = speculative_generate(model, draft, ids, max_new_tokens=40, k=4, temperature=0,
                                    eos_token_id=tok.eos_token_id, compile=True)
    ars = autoregressive_generate(model, ids, max_new_tokens=40, temperature=0, eos_token_id=tok.eos_token_id,
                                  compile=True)
    hf = model.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=tok.eos_token_id)
    assert spec_gen.tokens[0].tolist() == ars.tokens[0].tolist() == hf[0, ids.shape[1]:].tolist()
    assert spec_gen.stats.accepted < spec_gen.stats.drafted


@pytest.mark.slow
def test_a_recipe_validates_with_compiled_sampling(tmp_path):
    """`sampler.compile=true`: val/alpha comes from the compiled sampler, the pruned-head draft read as trained."""
    import csv

    from conftest import run_entry

    res = run_entry("recipe=smoke", "sampler.compile=true", f"hydra.run.dir={tmp_path}")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = list(csv.DictReader((tmp_path / "csv" / "metrics.csv").open()))
    alphas = [float(r["val/alpha"]) for r in rows if r.get("val/alpha")]
    assert len(alphas) >= 2 and all(0 <= a <= 1 for a in alphas)
