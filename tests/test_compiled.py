"""The compiled static-shape path (`compile=True`, sampling/compiled.py) is as exact as the eager one.

Each test compiles real inductor graphs (about 10-20 s a shape on 2 cores; the chi-square tests take 20-70 s),
so the statistical ones are marked slow and run in CI (`python -m pytest -m slow`).
"""


import pytest
import torch
from conftest import tiny_llama
from helpers import counts_of, pvalue
from test_exactness import Dist, target_sequences

import draftsmith.sampling.compiled as compiled
import draftsmith.sampling.speculative as spec
from draftsmith.sampling import autoregressive_generate, speculative_generate
from draftsmith.sampling.probs import SamplingConfig
from draftsmith.sampling.pruned import PrunedHeadDraft

V = 5


@pytest.fixture(scope="module")
def pair():
    return tiny_llama(vocab=V, seed=0, logit_scale=8.0), tiny_llama(vocab=V, layers=1, hidden=16, seed=1,
                                                                    logit_scale=6.0)


@pytest.mark.slow
@pytest.mark.parametrize("frozen", [False, True], ids=["inputs", "frozen"])
def test_compiled_speculative_generate_passes_chi_square(pair, monkeypatch, frozen):
    """50k rows through compiled steps: holes compacted after every loop that leaves one, rows ending at EOS
    kept in the static batch unread; the output is still exactly the target's distribution. Both graphs: weights
    as inputs, and frozen into the graph with inductor's GEMM template."""
    if frozen:
        monkeypatch.setattr(compiled, "FREEZE_DTYPES", (torch.float32,))
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
    assert all((m.__dict__["_draftsmith_step"].key is not None) == frozen for m in (target, pruned))
    assert any(len(t) < budget for t in gen.tokens)  # some rows ended early at EOS
    shapes = {(r["model"], r["tokens"]) for r in compiled.compile_report()}
    assert ("LlamaForCausalLM (2 layers)", 2) in shapes and ("PrunedHeadDraft (1 layers)", 1) in shapes
    assert pvalue(counts_of(gen), exact) > 1e-3


@pytest.fixture
def freeze_fp32(monkeypatch):
    """The frozen path (inductor freezing + GEMM template, for bf16 weights) on fp32 models, whose rounding is
    small enough for exact comparisons."""
    monkeypatch.setattr(compiled, "FREEZE_DTYPES", (torch.float32,))


def test_frozen_weights_are_frozen_only_in_half_precision():
    model = tiny_llama(vocab=V, layers=1, hidden=16, seed=3)
    assert compiled._weights_key(model) is None  # fp32: the calibrated kernels, weights as inputs
    assert compiled._weights_key(model.to(torch.bfloat16)) is not None
    assert compiled._weights_key(model.requires_grad_(True)) is None  # may be trained: never baked in


@pytest.mark.slow  # among the longest: the default suite stays under its 12 minutes
def test_frozen_graphs_serve_every_generation(freeze_fp32):
    """Each generation brings a new static cache; a frozen graph must read and write that one, not the cache it
    was compiled with (StaticCache's tensors are tagged like weights). Greedy, compiled == eager, three times. K 1:
    its 2-token verify is the width the draft's catch-up step compiles anyway (why a small K: docs/design.md, "Tests
    and CI time")."""
    from draftsmith.drafts.build import truncated_target

    target = tiny_llama(vocab=64, layers=3, hidden=32, seed=5, logit_scale=4.0)
    draft = truncated_target(target, 1).requires_grad_(False)  # agrees sometimes
    accepted = drafted = 0
    g = torch.Generator().manual_seed(0)
    for length in (5, 12, 7):
        ids = torch.randint(0, 64, (1, length), generator=g)
        eager = autoregressive_generate(target, ids, max_new_tokens=24, temperature=0).tokens[0].tolist()
        ars = autoregressive_generate(target, ids, max_new_tokens=24, temperature=0, compile=True)
        sps = speculative_generate(target, draft, ids, max_new_tokens=24, k=1, temperature=0, compile=True)
        assert ars.tokens[0].tolist() == sps.tokens[0].tolist() == eager
        accepted, drafted = accepted + sps.stats.accepted, drafted + sps.stats.drafted
    assert 0 < accepted < drafted  # both branches of the loop ran
    assert target.__dict__["_draftsmith_step"].key is not None and draft.__dict__["_draftsmith_step"].key is not None


# the frozen case compiles and autotunes its graph twice (the change in place throws the first away): over the
# default suite's ~20 s line (docs/results.md), so slow; the trained case stays in the default suite
@pytest.mark.parametrize("trained", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["trained", "frozen"])
def test_compiled_steps_read_the_weights_as_they_are_now(trained, freeze_fp32):
    """A draft validated between optimiser steps is updated in place: its compiled step must not have the old
    weights baked into its graph. A frozen model's graph has them baked in (inductor's freezing), so a change in
    place must throw that graph away."""
    model = tiny_llama(vocab=V, layers=1, hidden=16, seed=3).requires_grad_(trained)
    assert (compiled._weights_key(model) is None) == trained
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
    target's own greedy decoding (transformers, eager), token for token. K 2, the smallest with a verify over more
    than one draft token: each width is a 30-layer graph compiled cold (docs/design.md, "Tests and CI time")."""
    from draftsmith.drafts.build import truncated_target

    model, tok = demo_target
    draft = truncated_target(model, 4).eval()
    ids = tok("def quicksort(xs):\n", return_tensors="pt").input_ids
    before = len(compiled.compile_report())  # the shapes compiled by earlier tests of this process are not these
    spec_gen = speculative_generate(model, draft, ids, max_new_tokens=24, k=2, temperature=0,
                                    eos_token_id=tok.eos_token_id, compile=True)
    ars = autoregressive_generate(model, ids, max_new_tokens=24, temperature=0, eos_token_id=tok.eos_token_id,
                                  compile=True)
    hf = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=tok.eos_token_id)
    assert spec_gen.tokens[0].tolist() == ars.tokens[0].tolist() == hf[0, ids.shape[1]:].tolist()
    assert spec_gen.stats.accepted < spec_gen.stats.drafted
    # what ran was compiled: the demo's own shapes (its GQA and tied head), the target's and the cut draft's
    built = {(r["model"], r["tokens"]) for r in compiled.compile_report()[before:]}
    layers = model.config.num_hidden_layers
    assert {(f"{type(model).__name__} ({layers} layers)", 3), (f"{type(model).__name__} ({layers} layers)", 1),
            (f"{type(draft).__name__} (4 layers)", 1)} <= built  # K + 1, plain decoding's step, a draft step


@pytest.mark.slow
def test_a_recipe_validates_with_compiled_sampling(tmp_path):
    """`sampler.compile=true`: val/alpha comes from the compiled sampler, the pruned-head draft read as trained."""
    import csv
    import json

    from conftest import run_entry

    # K 1: the subject is the wiring, and each verify width is a graph compiled cold (docs/design.md)
    res = run_entry("recipe=smoke", "sampler.compile=true", "sampler.k=1", f"hydra.run.dir={tmp_path}")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = list(csv.DictReader((tmp_path / "csv" / "metrics.csv").open()))
    alphas = [float(r["val/alpha"]) for r in rows if r.get("val/alpha")]
    assert len(alphas) >= 2 and all(0 <= a <= 1 for a in alphas)
    # the validations' steps were compiled: the pruned-head draft's one-token step and the target's K+1 (an eager
    # run's report lists none)
    report = json.loads((tmp_path / "report.json").read_text())
    built = {(r["model"].split(" (")[0], r["tokens"]) for r in report["compiled"]}
    assert ("PrunedHeadDraft", 1) in built and any(m != "PrunedHeadDraft" and t > 1 for m, t in built), built
