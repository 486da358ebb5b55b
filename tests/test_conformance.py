"""draftsmith deploy-check: the judge of engines is itself judged. It passes our exact sampler, rejects a sampler
with a planted residual bug (its stated power says it must), and refuses bundles that are incomplete or edited."""

import json
import shutil

import pytest
import torch

from draftsmith.deploy.conformance import (
    LEVEL,
    Setting,
    check,
    chi2_power,
    main,
    open_bundle,
)
from draftsmith.engines.draftsmith import DraftsmithEngine
from draftsmith.sampling import rejection


@pytest.fixture(scope="module")
def sharp_bundle(tmp_path_factory):
    """A pair that disagrees often (alpha ~0.2), so a wrong residual moves the output distribution a lot: the
    tiny random target sharpened x4 and its own first layer sharpened x6 as the draft."""
    from draftsmith.deploy.export import export
    from draftsmith.drafts.build import truncated_target
    from draftsmith.sampling.load import load_model, load_tokenizer

    root = tmp_path_factory.mktemp("conformance")
    tok = load_tokenizer("tiny-random")
    target = load_model("tiny-random", "fp32")
    draft = truncated_target(load_model("tiny-random", "fp32"), 1)
    for model, scale, name in ((target, 4.0, "target"), (draft, 6.0, "draft")):
        with torch.no_grad():
            model.model.norm.weight.mul_(scale)  # RMSNorm's weight scales the logits
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return export(root / "draft", root / "bundle", target_arg=str(root / "target"), n_prompts=2, max_new_tokens=16,
                  dtype="fp32", ks=(1, 2))


SETTINGS = [Setting(0.0), Setting(0.8, 0.95)]
KW = dict(draws=4000, n_prompts=2, samples=4, max_new_tokens=24)


def test_check_passes_our_sampler_with_stated_power(sharp_bundle):
    bundle = open_bundle(sharp_bundle)
    report = check(bundle, DraftsmithEngine(bundle), SETTINGS, **KW)
    assert report["verdict"] == "pass", report["settings"]
    greedy, sampled = report["settings"]["greedy"], report["settings"]["T0.8 top-p 0.95"]
    assert greedy["identical"] == 2
    dist = sampled["distribution"]
    assert dist["p_speculative"] >= LEVEL and dist["cells"] > 20
    assert dist["power_vs_planted_bug"] > 0.99  # so the next test must see the bug
    assert 0 < sampled["engine_acceptance"] < 0.9 and sampled["logprob"]["samples"] == 8


def test_check_rejects_a_planted_residual_bug(sharp_bundle, monkeypatch):
    monkeypatch.setattr(rejection, "residual", lambda p, q: q)  # after a rejection, resample from q: biased
    bundle = open_bundle(sharp_bundle)
    report = check(bundle, DraftsmithEngine(bundle), SETTINGS[1:], **KW)
    r = report["settings"]["T0.8 top-p 0.95"]
    assert report["verdict"] == "fail" and r["verdict"] == "fail"
    assert r["distribution"]["p_speculative"] < LEVEL <= r["distribution"]["p_plain"]


def test_power_follows_the_noncentral_chi_square():
    null = [0.25] * 4
    assert chi2_power(null, null, 1000) == pytest.approx(LEVEL, rel=1e-6)  # no effect: power is the level
    alt = [0.3, 0.2, 0.25, 0.25]
    assert chi2_power(null, alt, 100) < chi2_power(null, alt, 2000) and chi2_power(null, alt, 2000) > 0.9


def test_cli_records_the_verdict_in_the_card_and_fails_with_status_3(sharp_bundle, tmp_path, monkeypatch, capsys):
    b = tmp_path / "b"
    shutil.copytree(sharp_bundle, b)
    monkeypatch.setattr(rejection, "residual", lambda p, q: q)
    rc = main([str(b), "--engine", "draftsmith", "--no-greedy", "--draws", "4000", "--n-prompts", "1",
               "--samples", "2", "--max-new-tokens", "8"])
    assert rc == 3 and "not lossless at: T0.8 top-p 0.95" in capsys.readouterr().err
    spec = json.loads((b / "speculative.json").read_text())
    assert spec["deployment"]["draftsmith"]["verdict"] == "fail"
    assert "| draftsmith |" in (b / "README.md").read_text()
    open_bundle(b)  # the card changed, the checked files did not


def test_cli_refuses_an_edited_or_incomplete_bundle_or_a_missing_engine(sharp_bundle, tmp_path, monkeypatch,
                                                                         capsys):
    edited, partial = tmp_path / "edited", tmp_path / "partial"
    shutil.copytree(sharp_bundle, edited)
    shutil.copytree(sharp_bundle, partial)
    cfg = edited / "draft" / "config.json"
    cfg.write_text(cfg.read_text().replace('"num_hidden_layers": 1', '"num_hidden_layers": 2'))
    (partial / "draft" / "model.safetensors").unlink()
    assert main([str(edited), "--engine", "draftsmith"]) == 2
    assert "draft/config.json changed after export" in capsys.readouterr().err
    assert main([str(partial), "--engine", "draftsmith"]) == 2
    assert "draft/model.safetensors is missing" in capsys.readouterr().err
    assert main([str(tmp_path), "--engine", "draftsmith"]) == 2
    assert "is not a bundle" in capsys.readouterr().err
    monkeypatch.setenv("DRAFTSMITH_VLLM_PYTHON", str(tmp_path / "no-such-python"))
    assert main([str(sharp_bundle), "--engine", "vllm"]) == 2
    assert "draftsmith engines install vllm" in capsys.readouterr().err


def test_greedy_ties_are_judged_at_the_precision_the_engine_computes_in():
    """A verify pass of K + 1 tokens rounds differently from 1-token steps: in fp32 the logits barely move with the
    pass's shape, in bf16 by a good part of a logit. The greedy check allows a divergence only between candidates
    closer than twice that shape noise; a wider gap still fails."""
    from conftest import tiny_llama

    from draftsmith.deploy.conformance import _judge_greedy, shape_noise

    model = tiny_llama(vocab=256, layers=2, hidden=128, heads=4, seed=4, logit_scale=8.0)
    prompts, cont = [[1, 5, 9, 3, 17, 22, 8, 40]], [[7, 2, 11, 4, 8, 6, 30, 31, 12, 13]]
    fp32 = shape_noise(model, prompts, cont)
    bf16 = shape_noise(model.to(torch.bfloat16), prompts, cont)
    model.float()
    assert fp32 < 1e-4 < bf16
    with torch.no_grad():
        logits = model(torch.tensor([prompts[0]])).logits[0, -1]
    order = logits.argsort(descending=True).tolist()
    gap = float(logits[order[0]] - logits[order[-1]])  # the best and the worst candidate: far apart
    plain, spec = [[[order[0]]]], [[[order[-1]]]]
    assert _judge_greedy(model, prompts, plain, spec, 1e-3, noise=0.0)["verdict"] == "fail"
    assert _judge_greedy(model, prompts, plain, spec, 1e-3, noise=gap / 2 + 1e-3)["verdict"] == "pass"
    assert _judge_greedy(model, prompts, plain, spec, 1e-3, noise=gap / 2 - 1e-3)["verdict"] == "fail"
