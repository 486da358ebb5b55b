"""Export of a draft+target bundle from a smoke run: reload, assisted generation, our sampler, refusals."""

import json

import pytest
import torch
from conftest import copy_with_swapped_tokens
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftsmith.sampling import speculative_generate
from draftsmith.sampling.pruned import HEAD_TOKENS, TOKEN_COUNTS


@pytest.fixture(scope="module")
def bundle(smoke_run, tmp_path_factory):
    from draftsmith.deploy.export import export

    run_dir, _ = smoke_run
    out = tmp_path_factory.mktemp("bundle") / "pair"
    export(run_dir, out, n_prompts=2, max_new_tokens=16, ks=(1, 2, 3, 4))
    return run_dir, out


def test_bundle_layout_and_acceptance_card(bundle):
    _, out = bundle
    spec = json.loads((out / "speculative.json").read_text())
    assert {"code", "english"} == set(spec["acceptance"]) and 1 <= spec["recommended_k"] <= 4
    assert spec["sampling"] == {"temperature": 0.8, "top_p": 0.95, "top_k": 0}
    vllm = json.loads((out / "vllm_speculative_config.json").read_text())
    assert vllm["method"] == "draft_model" and vllm["num_speculative_tokens"] == spec["recommended_k"]
    cfg = json.loads((out / "draft" / "config.json").read_text())
    assert "speculators_config" not in cfg  # the speculators format has no independent-draft algorithm
    assert set(spec["files"]) >= {"draft/config.json", "draft/model.safetensors", "target.json",
                                  "vllm_speculative_config.json"}  # hashed, so deploy_check can refuse edits
    assert (out / "draft" / "model.safetensors").is_file() and (out / "draft" / "tokenizer.json").is_file()
    assert (out / "draft" / TOKEN_COUNTS).is_file()  # for --draft-vocab; not at the top, where vLLM loads weights
    # the smoke draft is trained with a pruned head: its tokens ride along and our sampler loads it with them
    assert (out / "draft" / HEAD_TOKENS).is_file() and spec["draft_head_tokens"] in (128, 129)
    assert sorted(p.name for p in (out / "draft").glob("*.safetensors")) == ["model.safetensors"]
    ref = json.loads((out / "target.json").read_text())
    assert len(ref["config_sha256"]) == 64 and len(ref["tokenizer_sha256"]) == 64
    card = (out / "README.md").read_text()
    assert "assistant_model=draft" in card and "vllm serve" in card and "draftsmith generate" in card
    assert not list(out.parent.glob(".pair.partial-*"))  # atomic: no leftovers
    # what the speed figures ran on: the card and the spec name the CPU and each model's precision
    assert set(spec["dtype"]) == {"target", "draft"} and spec["machine"]["threads"] >= 1
    assert spec["machine"]["cpu_capability"] in card and f"target {spec['dtype']['target']}" in card
    # the card's picture: acceptance by position and the predicted speed-up by K, embedded
    assert (out / "acceptance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "](acceptance.png)" in card


def test_bundle_runs_in_transformers_assisted_generation_and_in_our_sampler(bundle):
    from draftsmith.sampling.load import load_model
    from draftsmith.sampling.names import resolve

    _, out = bundle
    target = AutoModelForCausalLM.from_pretrained(resolve("tiny-random"))
    tok = AutoTokenizer.from_pretrained(out / "draft")
    draft = AutoModelForCausalLM.from_pretrained(out / "draft")
    ids = tok("def f(x):", return_tensors="pt").input_ids
    hf = target.generate(ids, assistant_model=draft, do_sample=True, temperature=0.8, top_p=0.95, max_new_tokens=12,
                         min_new_tokens=12, pad_token_id=tok.eos_token_id)
    assert hf.shape[1] == ids.shape[1] + 12
    spec = json.loads((out / "speculative.json").read_text())
    ours = speculative_generate(load_model("tiny-random", "bf16"), load_model(str(out / "draft"), "bf16"), ids,
                                max_new_tokens=12, k=spec["recommended_k"], temperature=0.8, top_p=0.95,
                                generator=torch.Generator().manual_seed(0))
    assert len(ours.tokens[0]) == 12 and ours.stats.alpha is not None


def test_export_refuses_a_mismatched_pair(bundle, tmp_path):
    from draftsmith.deploy.export import export
    from draftsmith.sampling.errors import DraftsmithError

    _, out = bundle
    broken = copy_with_swapped_tokens(out / "draft", tmp_path / "draft")
    with pytest.raises(DraftsmithError, match="vocabularies differ"):
        export(broken, tmp_path / "never", target_arg="tiny-random", n_prompts=1, max_new_tokens=4, ks=(1,))
    assert not (tmp_path / "never").exists()


def test_export_refuses_what_is_not_a_run(tmp_path):
    from draftsmith.deploy.export import main

    assert main([str(tmp_path), "--out", str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists()


def test_deploy_check_judges_the_pruned_smoke_bundle_in_transformers(bundle, tmp_path, capsys):
    """The bundle the main job makes (a pruned head) in transformers' assisted generation: the engine hands it the
    draft as a plain model and the check runs to its end, where it used to end in a traceback inside transformers;
    greedy output equals plain decoding. The sampled setting here is a no-crash check only: on tiny-random's
    near-uniform logits 300 draws pool into about one chi-square cell, whose p-value is 1 by construction, so its
    "pass" says nothing (the sampled judge's power is tested on the sharpened pair in tests/test_conformance.py)."""
    import shutil

    from draftsmith.deploy.conformance import main

    _, out = bundle
    b = tmp_path / "b"
    shutil.copytree(out, b)
    rc = main([str(b), "--engine", "transformers", "--draws", "300", "--n-prompts", "2", "--samples", "2",
               "--max-new-tokens", "8"])
    printed = capsys.readouterr()
    assert rc == 0, printed.err[-2000:]
    assert "greedy" in printed.out and "PASS" in printed.out
    report = json.loads((b / "speculative.json").read_text())["deployment"]["transformers"]
    assert report["verdict"] == "pass" and report["settings"]["greedy"]["verdict"] == "pass"
    sampled = [r for name, r in report["settings"].items() if name != "greedy"]
    assert len(sampled) == 1 and sampled[0]["distribution"]["draws"] == 300  # it ran, to its end
    # the one-page summary: the verdict table and its picture in the card
    card = (b / "README.md").read_text()
    assert "| transformers |" in card and "](deployment.png)" in card
    assert (b / "deployment.png").read_bytes()[:4] == b"\x89PNG"


def test_deploy_check_names_the_engine_and_bundle_when_the_engine_crashes(bundle, tmp_path, monkeypatch, capsys):
    from draftsmith.deploy.conformance import main
    from draftsmith.engines.transformers import TransformersEngine

    _, out = bundle

    def crash(self, jobs, speculative):
        raise AttributeError("'X' object has no attribute 'device'")

    monkeypatch.setattr(TransformersEngine, "run", crash)
    assert main([str(out), "--engine", "transformers", "--no-write"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: transformers failed on {out}: AttributeError: 'X' object has no attribute")
    assert "Traceback" not in "\n".join(err)


@pytest.mark.slow
def test_export_logs_the_bundle_to_the_runs_wandb_run(smoke_run, tmp_path):
    """`export RUN` resumes the W&B run that trained the draft (its id in OUT_DIR/wandb_id) and adds the bundle as a
    `bundle` artifact beside the `model` one: read from the offline run files, what `wandb sync` uploads."""
    import shutil

    from helpers import wandb_records

    from draftsmith.deploy.export import main

    run = tmp_path / "run"
    shutil.copytree(smoke_run[0], run)
    run_id = (run / "wandb_id").read_text().strip()
    before = set((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert main([str(run), "--out", str(tmp_path / "bundle"), "--n-prompts", "1", "--max-new-tokens", "8",
                 "--wandb"]) == 0
    (new,) = set((run / "wandb").glob("offline-run-*/run-*.wandb")) - before
    recs = wandb_records(new)
    assert {r.run.run_id for r in recs if r.WhichOneof("record_type") == "run"} == {run_id}
    (art,) = [r.artifact for r in recs if r.WhichOneof("record_type") == "artifact"]
    assert art.type == "bundle" and art.name == f"bundle-{run_id}"
    files = {e.path for e in art.manifest.contents}
    assert {"speculative.json", "vllm_speculative_config.json", "draft/model.safetensors", "README.md"} <= files
    assert main([str(run), "--out", str(tmp_path / "b2"), "--n-prompts", "1", "--max-new-tokens", "8"]) == 0
    assert len(set((run / "wandb").glob("offline-run-*/run-*.wandb"))) == len(before) + 1


def test_each_verb_takes_what_the_one_before_made(bundle, capsys):
    """`draftsmith generate --draft BUNDLE` runs the bundle's draft with its target and its recommended K (a bundle
    was refused as "no config.json", and its draft dir ran K 4); `--draft RUN_DIR` runs the run's best draft with its
    target; `draftsmith bench paper` takes the bundle too."""
    from draftsmith.deploy.cli import main

    run_dir, out = bundle
    spec = json.loads((out / "speculative.json").read_text())
    assert main(["generate", "--draft", str(out), "--prompt", "def f(x):", "--max-new-tokens", "8", "--json",
                 "--device", "cpu"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["k"] == spec["recommended_k"] and stats["new_tokens"] <= 8
    assert main(["generate", "--draft", str(out), "-k", "3", "--prompt", "x", "--max-new-tokens", "4", "--json",
                 "--device", "cpu"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["k"] == 3  # what is given wins
    assert main(["generate", "--draft", str(run_dir), "--prompt", "x", "--max-new-tokens", "4", "--json",
                 "--device", "cpu"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["k"] == 4
    bench = out.parent / "bench"
    assert main(["bench", "paper", "--draft", str(out), "--n-prompts", "1", "--max-new-tokens", "8", "--k-sweep", "0",
                 "1", "-k", "1", "--no-k-auto", "--no-peers", "--out", str(bench), "--device", "cpu"]) == 0
    record = json.loads((bench / "bench.json").read_text())
    assert record["args"]["target"].endswith("tiny-random") and (bench / "figure1.png").is_file()


def _card_spec(chat):
    """The spec fields the card reads (what `export` measured), with `chat_template` as a data=chat run records it."""
    return {"recommended_k": 3, "measured_k": 4, "sampling": {"temperature": 0.8, "top_p": 0.95, "top_k": 0},
            "acceptance": {"code": {"tokens_per_call": 2.0, "alpha": 0.5, "alpha_analytic": 0.5,
                                    "acceptance_by_position": [0.6, None]}},
            "max_new_tokens": 16, "seed": 0, "c": 0.1, "predicted_speedup": {"3": 1.5}, "device": "cpu",
            "machine": {"cpu": "cpu", "cuda": False, "torch": "2", "cpu_capability": "AVX2", "native_bf16": False,
                        "threads": 2}, "dtype": {"target": "fp32", "draft": "fp32"}, "feature_layers": [1, 2, 3],
            "chat_template": chat}


@pytest.mark.parametrize("thinking, flags", [(False, "--chat --enable-thinking false"), (None, "--chat --prompt")])
def test_a_chat_trained_draft_s_card_applies_the_template(tmp_path, thinking, flags):
    """A run trained with data=chat (its config says so): the card says the draft was trained and measured through
    the target's chat template, records enable_thinking, and its commands apply the template; a text run's card
    has none of it."""
    import yaml

    from draftsmith.deploy.export import feature_card, model_card, trained_chat

    run = tmp_path / "run"
    (run / "best_draft").mkdir(parents=True)
    (run / ".hydra").mkdir()
    (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"data": {"format": "chat",
                                                                         "enable_thinking": thinking}}))
    chat = trained_chat(run)
    assert chat == {"enable_thinking": thinking}
    assert trained_chat(run / "checkpoints" / "step1.ckpt") == chat  # a checkpoint of the run: the same run
    said = "the template's default" if thinking is None else "false"
    for card in (model_card("pair", "t", _card_spec(chat)), feature_card("pair", "t", _card_spec(chat))):
        assert "through the target's chat template" in card and f"enable_thinking: {said}" in card
        assert f"--top-p 0.95 {flags}" in card
    assert "apply_chat_template" in model_card("pair", "t", _card_spec(chat))
    (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"data": {"format": "text"}}))
    assert trained_chat(run) is None
    plain = model_card("pair", "t", _card_spec(None))
    assert "--chat" not in plain and "chat template (data=chat" not in plain and "apply_chat_template" not in plain


def test_the_cards_commands_carry_the_k_each_engine_was_measured_fastest_at():
    """`export --engines` writes each engine's fastest K into its config; the card's commands must say the same K,
    not the recommended one (first seen: `generation_config.json` held K 2 while the card said it fixes K 1)."""
    from draftsmith.deploy.export import feature_card, model_card

    spec = _card_spec(None)
    assert "fixes K=3," in model_card("pair", "t", spec) and "-k 3 " in feature_card("pair", "t", spec)
    spec["engine_k"] = {"transformers": {"best_k": 2}, "draftsmith": {"best_k": 4}}
    card = model_card("pair", "t", spec)
    assert "fixes K=2," in card and "-k 4 " in card and "-k 4 " in feature_card("pair", "t", spec)
