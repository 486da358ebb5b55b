"""Draft training end to end: recipes, the smoke run, resume, distributed configs, bad input."""

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import refusal, run_entry, tiny_llama
from helpers import fit_losses
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch.utils.data import DataLoader, TensorDataset

from draftsmith.sampling.pruned import HEAD_TOKENS, TOKEN_COUNTS

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "recipes"


def group_files():
    for group in sorted(p for p in RECIPES.iterdir() if p.is_dir() and p.name != "prompts"):
        for f in sorted(group.glob("*.yaml")):
            yield group.name, f.stem


def compose_cfg(*overrides):
    with initialize_config_dir(config_dir=str(RECIPES), version_base="1.3"):
        return compose("draft", overrides=["out_dir=/tmp/unused", *overrides])


@pytest.mark.parametrize("group,name", list(group_files()), ids=[f"{g}/{n}" for g, n in group_files()])
def test_every_recipe_file_composes_and_instantiates(group, name, tmp_path):
    cfg = compose_cfg(f"{group}={name}", f"out_dir={tmp_path}")
    OmegaConf.resolve(cfg)
    from draftsmith.drafts.build import DraftConfig
    from draftsmith.train.tracking import loggers

    built = loggers(cfg)  # every logger entry is built by its _target_
    assert {type(lg).__name__ for lg in built} >= {"CSVLogger"} and all(lg.save_dir == str(tmp_path) for lg in built)
    for spec in cfg.callbacks.values():  # and every extra callback
        cb = instantiate(spec)
        assert getattr(cb, "monitor", cfg.checkpoint.monitor) == cfg.checkpoint.monitor

    DraftConfig(**OmegaConf.to_container(cfg.draft))
    kwargs = OmegaConf.to_container(cfg.trainer)
    if isinstance(kwargs.get("strategy"), dict):
        kwargs["strategy"] = instantiate(cfg.trainer.strategy)
        if "DeepSpeed" in type(kwargs["strategy"]).__name__:
            from deepspeed.runtime.config import DeepSpeedConfig

            ds = dict(kwargs["strategy"].config, train_micro_batch_size_per_gpu=cfg.data.batch_size,
                      gradient_accumulation_steps=1)
            DeepSpeedConfig(ds)  # validates stage, offload and batch keys as DeepSpeed itself would
            assert ds["zero_optimization"]["stage"] == (int(name[-1]) if group == "trainer" else 3)
        else:
            from lightning.pytorch.strategies import FSDPStrategy

            assert isinstance(kwargs["strategy"], FSDPStrategy) and kwargs["devices"] == "auto"
    if kwargs["accelerator"] == "cpu":
        from draftsmith.sampling.precision import trainer_precision

        kwargs["precision"] = trainer_precision(kwargs["precision"], "cpu")  # `auto`, resolved as train/draft.py does
        kwargs.update(logger=loggers(OmegaConf.create({"logger": {"csv": {
            "_target_": "lightning.pytorch.loggers.CSVLogger", "save_dir": "/tmp"}, "wandb": None}})),
                      enable_checkpointing=False)
        L.Trainer(**kwargs)
    if group == "recipe":
        assert "_global_" in (RECIPES / group / f"{name}.yaml").read_text()


def test_recipe_overrides_reach_the_config():
    cfg = compose_cfg("recipe=shallow_wide")
    assert cfg.draft.init == "target" and cfg.loss.weights.tv == 1.0 and cfg.target.name == "smollm2-135m"
    assert compose_cfg("recipe=smoke").target.name == "tiny-random"


def test_draft_is_shallow_and_wide_from_the_targets_config():
    from transformers import LlamaConfig

    from draftsmith.drafts.build import DraftConfig, draft_config_for

    paper_target = LlamaConfig(num_hidden_layers=80, hidden_size=8192, num_attention_heads=64, num_key_value_heads=8,
                               intermediate_size=28672, vocab_size=32000)
    d = draft_config_for(paper_target, DraftConfig())
    assert d.num_hidden_layers == 8 and d.hidden_size == 6144 and d.vocab_size == 32000  # the paper's 4B draft
    smol = LlamaConfig(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                       intermediate_size=1536, vocab_size=49152)
    d = draft_config_for(smol, DraftConfig())
    assert d.num_hidden_layers == 3 and d.hidden_size == 432 and d.num_key_value_heads == 3
    assert draft_config_for(smol, DraftConfig(depth_ratio=0.01)).num_hidden_layers == 2  # at least 2 layers
    with pytest.raises(ValueError, match="heads"):
        draft_config_for(smol, DraftConfig(hidden=500))
    with pytest.raises(ValueError, match="width"):
        draft_config_for(smol, DraftConfig(init="target"))


def test_a_draft_built_from_the_targets_files_equals_one_built_from_the_loaded_target():
    """A rank that holds no target builds its draft from the target's safetensors, read by name (tied head
    included); every rank starts from the same weights as the one that loaded the model."""
    from draftsmith.drafts.build import DraftConfig, TargetWeights, build_draft
    from draftsmith.sampling.load import load_model

    cfg = DraftConfig(layers=2, width_ratio=1.0, init="target", init_layers=[0, 2])
    loaded = build_draft(load_model("tiny-random", "fp32"), cfg).state_dict()
    weights = TargetWeights.of("tiny-random")
    assert weights.config.tie_word_embeddings and "lm_head.weight" in weights
    read = build_draft(weights, cfg).state_dict()
    assert list(read) == list(loaded) and all(torch.equal(read[k], loaded[k]) for k in loaded)


def test_training_changes_the_draft_and_never_the_target(tmp_path):
    """Real Lightning fit with online distillation: draft weights move, the target's stay bit-identical and
    never enter the checkpoint."""
    from conftest import tiny_llama

    from draftsmith.drafts.build import DraftConfig, build_draft
    from draftsmith.train.module import DraftModule

    target = tiny_llama(vocab=32, layers=2, hidden=32, seed=0, logit_scale=3.0)
    draft = build_draft(target, DraftConfig(layers=1, width_ratio=1.0, init="target"))
    before_t = {k: v.clone() for k, v in target.state_dict().items()}
    before_d = {k: v.clone() for k, v in draft.state_dict().items()}
    loss = {"distill": True, "temperature": 1.0, "weights": {"tv": 1, "forward_kl": 1}, "compile": False}
    module = DraftModule(draft, target, loss=loss,
                         optim={"lr": 1e-2, "warmup_steps": 1}, sampler={"temperature": 1.0}, max_steps=4)
    data = DataLoader(TensorDataset(torch.randint(0, 32, (16, 12))), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", max_steps=4, logger=False, enable_progress_bar=False,
                        default_root_dir=tmp_path, limit_val_batches=1, val_check_interval=2,
                        check_val_every_n_epoch=None, num_sanity_val_steps=0)
    trainer.fit(module, data, data)
    assert all(torch.equal(before_t[k], v) for k, v in target.state_dict().items())
    assert any(not torch.equal(before_d[k], v) for k, v in draft.state_dict().items())
    assert "val/alpha_analytic" in trainer.callback_metrics
    ckpt = torch.load(trainer.checkpoint_callback.best_model_path, weights_only=True)
    assert ckpt["state_dict"] and all(k.startswith("draft.") for k in ckpt["state_dict"])


def test_kept_teacher_logits_spare_the_target_after_the_first_epoch(tmp_path):
    """Real Lightning fit, 3 epochs of 2 batches: with loss.teacher_topk the target runs in the first epoch only,
    and the losses follow the full teacher's (k = V - 1 leaves out one token's mass, fp16 rounds the rest)."""
    from conftest import tiny_llama

    from draftsmith.data.teacher import TeacherCache
    from draftsmith.drafts.build import DraftConfig, build_draft
    from draftsmith.train.module import DraftModule

    blocks = torch.randint(0, 32, (8, 12), generator=torch.Generator().manual_seed(0))
    losses = {}
    for cached in (False, True):
        torch.manual_seed(0)
        target = tiny_llama(vocab=32, layers=2, hidden=32, seed=0, logit_scale=3.0)
        draft = build_draft(target, DraftConfig(layers=1, width_ratio=1.0, init="target"))
        calls = []
        target.register_forward_hook(lambda m, a, k, o: calls.append(1), with_kwargs=True)
        loss = {"distill": True, "temperature": 1.0, "weights": {"tv": 1, "forward_kl": 1}, "compile": False}
        cache = TeacherCache(8, 11, 31, 32) if cached else None
        module = DraftModule(draft, target, loss=loss, optim={"lr": 1e-2, "warmup_steps": 1},
                             sampler={"temperature": 1.0}, max_steps=6, teacher_cache=cache)
        losses[cached] = fit_losses(module, blocks, tmp_path)
        assert len(calls) == (2 if cached else 6)
    assert len(losses[True]) == 6 and losses[True][0] == pytest.approx(losses[False][0], rel=1e-2)
    assert losses[True] == pytest.approx(losses[False], rel=5e-2)  # a row mixed up with another: far off


def test_a_pruned_head_trains_over_its_tokens_only_and_loads_pruned(tmp_path):
    """draft.draft_vocab for an independent draft: the step computes only the head's rows (same numbers as the
    full head's), the teacher's kept logits come out in the head's order, validation runs the pruned draft, and
    the saved draft loads with that head (its other rows were never fitted), a damaged head file refused."""
    from draftsmith.data.teacher import TeacherCache
    from draftsmith.drafts.batch import Batch, HeadRows
    from draftsmith.drafts.build import DraftConfig, build_draft
    from draftsmith.drafts.saved import save_draft
    from draftsmith.sampling.load import load_model, load_tokenizer
    from draftsmith.sampling.pruned import HEAD_TOKENS, PrunedHeadDraft
    from draftsmith.train.module import DraftModule

    target = tiny_llama(vocab=32, layers=2, hidden=32, seed=0, logit_scale=3.0)
    draft = build_draft(target, DraftConfig(layers=1, width_ratio=1.0, init="target", freeze_embeddings=True))
    head = torch.tensor([0, 2, 3, 7, 11, 12, 20, 31])
    blocks = torch.randint(0, 32, (8, 12), generator=torch.Generator().manual_seed(0))
    b = Batch(blocks[:2])
    with torch.no_grad():
        torch.testing.assert_close(b.logits(draft, HeadRows(draft, head)), b.logits(draft)[..., head])
        cache = TeacherCache(8, 11, 6, 32)
        dense = cache.logits(torch.tensor([0, 1]), lambda miss: b.logits(target))
        pruned = TeacherCache(8, 11, 6, 32, columns=head)
        torch.testing.assert_close(pruned.logits(torch.tensor([0, 1]), lambda miss: b.logits(target)),
                                   dense[..., head])
    before = {k: v.clone() for k, v in draft.state_dict().items()}
    loss = {"distill": True, "temperature": 1.0, "weights": {"tv": 1, "forward_kl": 1}, "compile": False}
    module = DraftModule(draft, target, loss=loss, optim={"lr": 1e-2, "warmup_steps": 1},
                         sampler={"temperature": 1.0}, max_steps=4,
                         teacher_cache=TeacherCache(8, 11, 6, 32, columns=head), head_tokens=head)
    data = DataLoader(TensorDataset(blocks, torch.arange(8)), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", max_steps=4, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, default_root_dir=tmp_path, limit_val_batches=1,
                        val_check_interval=2, check_val_every_n_epoch=None, num_sanity_val_steps=0)
    trainer.fit(module, data, DataLoader(TensorDataset(blocks[:4]), batch_size=4))
    assert any(not torch.equal(before[k], v) for k, v in draft.state_dict().items())
    assert 0 < float(trainer.callback_metrics["val/alpha_analytic"]) <= 1
    assert isinstance(module.sampling_draft(), PrunedHeadDraft)

    out = save_draft(draft, load_tokenizer("tiny-random"), tmp_path / "best_draft", head_tokens=head)
    loaded = load_model(str(out), "fp32")
    assert isinstance(loaded, PrunedHeadDraft) and torch.equal(loaded.token_ids, head)
    with torch.no_grad():
        full, pruned = draft(input_ids=blocks[:1]).logits, loaded(input_ids=blocks[:1]).logits
    torch.testing.assert_close(pruned[..., head], full[..., head])
    assert bool((pruned[..., [1, 4, 30]] == float("-inf")).all())
    (out / HEAD_TOKENS).write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="head_tokens.safetensors is not a head-token file"):
        load_model(str(out), "fp32")


def test_smoke_recipe_trains_selects_and_reports(smoke_run):
    from transformers import AutoModelForCausalLM

    out, res = smoke_run
    report = json.loads((out / "report.json").read_text())
    assert "best draft:" in res.stdout and str(out / "best_draft") in res.stdout
    assert f"plot: {out / 'acceptance.png'}" in res.stdout and (out / "acceptance.png").stat().st_size > 10_000
    assert report["eval"]["best"]["code"]["alpha"] is not None and report["c"] > 0
    assert report["validation_history"] and report["validation_history"][-1]["step"] == 6
    # precision `auto` resolved on this machine, whichever way it went, and recorded with what it ran on
    assert report["training_precision"] in ("32-true", "bf16-mixed")
    assert report["dtype"]["target"] in ("fp32", "bf16") and report["machine"]["cpu_capability"]
    assert report["monitor"] == "val/alpha_on_target" and 0 < report["best_score"] <= 1
    # it selects: the best draft kept is the validation with the highest score, not the last or the worst of the two
    assert report["best_score"] == pytest.approx(max(v[report["monitor"]] for v in report["validation_history"]))
    assert 0 <= report["eval"]["best"]["code"]["alpha_on_target"] <= 1
    draft = AutoModelForCausalLM.from_pretrained(out / "best_draft")
    assert (out / "best_draft" / "model.safetensors").is_file() and draft.config.num_hidden_layers >= 2
    assert (out / "checkpoints" / "last.ckpt").is_file() and (out / "best_draft" / TOKEN_COUNTS).is_file()
    assert report["draft_head_tokens"] in (128, 129) and (out / "best_draft" / HEAD_TOKENS).is_file()  # +EOS
    rows = list(csv.DictReader((out / "csv" / "metrics.csv").open()))
    logged = {k for r in rows for k, v in r.items() if v}
    assert {"train/loss", "train/tv", "val/alpha", "val/alpha_analytic", "val/tokens_per_call", "train/lr",
            "val/predicted_speedup", "val/alpha_on_target"} <= logged
    runs = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert runs and runs[0].stat().st_size > 0


def test_a_draft_continues_from_a_saved_one(tmp_path):
    from draftsmith.drafts.build import DraftConfig, build_draft

    target = tiny_llama(vocab=64, layers=4)
    cfg = dict(layers=2, width_ratio=1.0, init="target", freeze_embeddings=True)
    trained = build_draft(target, DraftConfig(**cfg))
    with torch.no_grad():
        trained.model.layers[1].mlp.up_proj.weight.add_(1.0)  # stands for training
    trained.save_pretrained(tmp_path / "best_draft")
    resumed = build_draft(target, DraftConfig(**cfg, init_from=str(tmp_path / "best_draft")))
    assert all(torch.equal(a, b) for a, b in zip(trained.state_dict().values(), resumed.state_dict().values()))
    assert not resumed.get_input_embeddings().weight.requires_grad  # the recipe's freezing still applies
    with pytest.raises(ValueError, match="does not hold a draft of this shape"):
        build_draft(target, DraftConfig(**{**cfg, "layers": 3}, init_from=str(tmp_path / "best_draft")))


def _losses(run_dir) -> dict[int, float]:
    """train/loss by step; a step logged twice (by a killed run, then by its resumption) keeps the later value."""
    rows = csv.DictReader((run_dir / "csv" / "metrics.csv").open())
    return {int(r["step"]): float(r["train/loss"]) for r in rows if r.get("train/loss")}


def test_wandb_offline_run_holds_config_curves_tables_and_the_best_draft(smoke_run, tmp_path):
    """What `wandb sync` would upload, read from the offline run files: the whole resolved config and the machine,
    the validation curves and tables, the best draft as a model artifact; a resume continues the same W&B run."""
    import shutil

    from helpers import wandb_records

    out = tmp_path / "run"
    shutil.copytree(smoke_run[0], out)
    run_id = (out / "wandb_id").read_text().strip()
    (first,) = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    recs = wandb_records(first)
    kinds = lambda k: [r for r in recs if r.WhichOneof("record_type") == k]  # noqa: E731
    (run,) = kinds("run")
    assert run.run.run_id == run_id and run.run.project == "draftsmith"
    config = {u.key: json.loads(u.value_json) for r in kinds("config") for u in r.config.update}
    config.update({u.key: json.loads(u.value_json) for u in run.run.config.update})
    assert config["config"]["target"]["name"] == "tiny-random" and config["config"]["trainer"]["max_steps"] == 6
    assert config["run"]["machine"]["cpu_capability"] and config["training_precision"] in ("32-true", "bf16-mixed")
    assert config["corpus"]["source"] == "stdlib" and config["draft_params"] > 0
    logged = {i.key or "/".join(i.nested_key) for r in kinds("history") for i in r.history.item}
    assert {"val/alpha_on_target", "val/alpha", "train/loss", "val/c"} <= logged
    assert {"val/acceptance_by_position/_type", "val/tokens_per_call_by_k/_type", "val/samples/_type"} <= logged
    models = [r.artifact for r in kinds("artifact") if r.artifact.type == "model"]
    assert [m.name for m in models] == [f"draft-{run_id}"] and "best" in models[0].aliases
    files = {e.path for e in models[0].manifest.contents}
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= files

    res = run_entry("recipe=smoke", f"hydra.run.dir={out}", "ckpt_path=last", "trainer.max_steps=8")
    assert res.returncode == 0, res.stderr[-2000:]
    runs = sorted((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 2
    assert {r.run.run_id for f in runs for r in wandb_records(f) if r.WhichOneof("record_type") == "run"} == {run_id}


@pytest.mark.slow  # among the longest: the default suite stays under its 12 minutes
def test_sigkilled_run_resumes_on_the_same_loss_curve(smoke_run, tmp_path):
    """SIGKILL a real run after its first checkpoint; `ckpt_path=last` must continue with the batches, optimizer
    state and schedule the uninterrupted run (the smoke fixture, same recipe) had: the same losses, step for step."""
    import signal
    import time

    out = tmp_path / "run"
    args = [sys.executable, str(ROOT / "train" / "draft.py"), "recipe=smoke", f"hydra.run.dir={out}", "logger=csv"]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    last = out / "checkpoints" / "last.ckpt"
    while not last.exists() and proc.poll() is None:
        time.sleep(0.01)
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = torch.load(last, weights_only=True)["global_step"]
    assert 0 < killed_at < 6
    second = run_entry("recipe=smoke", f"hydra.run.dir={out}", "ckpt_path=last", "logger=csv")
    assert second.returncode == 0, second.stderr[-2000:]
    assert torch.load(last, weights_only=True)["global_step"] == 6
    whole, resumed = _losses(smoke_run[0]), _losses(out)
    after = [s for s in whole if s >= killed_at]  # CSV steps are 0-based: step s is optimiser step s + 1
    assert after and all(s in resumed for s in after)
    assert [resumed[s] for s in after] == pytest.approx([whole[s] for s in after], rel=1e-5)


REFUSED = [
    (["recipe=nope"], "recipe=nope: no such recipe; choose one of distill_kl, feature_head"),
    (["recipe=smoke", "trainer.max_stepz=3"], "max_stepz"),
    (["recipe=smoke", "data.blocksize=3"], "unknown setting data.blocksize: data takes source, text_field"),
    (["recipe=smoke", "+data.blocksize=3"], "unknown setting data.blocksize: data takes source, text_field"),
    (["recipe=smoke", "data.block_size=big"], "data.block_size: Value 'big' of type 'str' could not be converted"),
    (["recipe=smoke", "loss=tvv"], "loss=tvv: no such loss; choose one of ce, distill_tv"),
    (["recipe=smoke", "loss.teacher_topk=many"], "loss.teacher_topk: Value 'many'"),
    (["recipe=smoke", "data.source=/no/such/corpus"], "corpus not found"),
    (["recipe=smoke", "data.max_documents=1", "data.block_size=512"], "too small"),
    (["recipe=smoke", "draft=paper_ratio", "draft.hidden=30"], "heads"),
    (["recipe=smoke", "+draft.extra.vocab_size=100"], "vocabulary"),
    (["recipe=smoke", "draft.draft_vocab=512"], "prunes nothing"),
    (["recipe=smoke", "+draft.unknown=1"], "unknown setting draft.unknown: draft takes depth_ratio"),
    (["recipe=smoke", "draft.layers=three"], "draft.layers: Value 'three' of type 'str' could not be converted"),
    (["recipe=smoke", "+optim.lrr=1"], "unknown setting optim.lrr: optim takes lr, betas"),  # the schema
    (["recipe=smoke", "optim.lr=fast"], "Value 'fast' of type 'str' could not be converted to Float"),
    (["recipe=smoke", "trainer.max_time=00:00:9:40"], "trainer.max_time must read DD:HH:MM:SS"),
    (["recipe=smoke", "target.ranks=some"], "target.ranks must be all (a replica on every rank), first"),
    (["recipe=smoke", "target.ranks=first"], "target.ranks=first, but training calls the target (the corpus kept no"),
]


@pytest.mark.parametrize("overrides,msg", REFUSED)
def test_bad_input_fails_with_one_clear_line_and_no_output(tmp_path, overrides, msg):
    """Each refused in one line naming what to fix, before any checkpoint or draft is written: asked in-process
    through the entry's own preflight and `train` (conftest.refusal)."""
    assert msg in refusal(tmp_path / "run", *overrides)


# one refusal from each place the entry refuses: Hydra's composition (the preflight), the data checks, the
# target's placement after the corpus is read
@pytest.mark.parametrize("overrides,msg", [REFUSED[0], REFUSED[7], REFUSED[-1]], ids=["preflight", "data", "ranks"])
def test_a_refused_run_exits_2_with_one_error_line_and_no_output(tmp_path, overrides, msg):
    """The command line's side of a refusal: exit status 2, one `error:` line holding the message, no traceback,
    nothing written to the run dir."""
    out = tmp_path / "run"
    res = run_entry(*overrides, f"hydra.run.dir={out}", "logger=csv")
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert res.returncode == 2 and len(errors) == 1 and msg in errors[0], res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    assert not (out / "checkpoints").exists() and not (out / "best_draft").exists()


def test_unwritable_output_dir_is_refused(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    res = run_entry("recipe=smoke", f"hydra.run.dir={tmp_path}/run", f"out_dir={blocker}/sub", "logger=csv")
    assert res.returncode == 2 and "not writable" in res.stderr


def test_corpus_from_jsonl_parquet_and_text_files(tmp_path):
    from draftsmith.data.corpus import load_blocks
    from draftsmith.sampling.load import load_tokenizer

    tok = load_tokenizer("tiny-random")
    texts = [f"def f{i}(x):\n    return x * {i}\n" * 20 for i in range(40)]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in texts))
    import datasets

    datasets.Dataset.from_dict({"text": texts}).to_parquet(str(tmp_path / "b.parquet"))
    (tmp_path / "txt").mkdir()
    for i, t in enumerate(texts):
        (tmp_path / "txt" / f"{i}.txt").write_text(t)
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "saved"))
    sizes = []
    for src in ["a.jsonl", "b.parquet", "txt", "saved"]:
        b = load_blocks(str(tmp_path / src), tok, 32, val_fraction=0.1)
        assert b["train"].shape[1] == 32 and len(b["val"]) >= 2
        assert int(b["train"].max()) < len(tok)
        sizes.append(len(b["train"]) + len(b["val"]))
    # same documents, same token count, up to the split's block rounding (one block): a reader that lost documents
    # is off by many (each text here is ~10 blocks)
    assert max(sizes) - min(sizes) <= 1, sizes


def test_generated_corpus_is_resumable(tmp_path):
    from draftsmith.data.corpus import generate_corpus
    from draftsmith.sampling.load import load_model, load_tokenizer

    tok, target = load_tokenizer("tiny-random"), load_model("tiny-random", "fp32")
    path = tmp_path / "gen.jsonl"
    generate_corpus(target, tok, ["def a():", "import os"], path, max_new_tokens=8, batch_size=1, progress=False)
    first = path.read_text().splitlines()
    generate_corpus(target, tok, ["def a():", "import os", "class B:"], path, max_new_tokens=8, batch_size=1,
                    progress=False)
    lines = path.read_text().splitlines()
    assert lines[:2] == first and len(lines) == 3 and json.loads(lines[2])["text"].startswith("class B:")
    # a complete cached corpus: a new run reads it as it is (it crashed closing an empty batch iterator)
    assert generate_corpus(target, tok, ["def a():", "import os", "class B:"], path, max_new_tokens=8,
                           batch_size=1, progress=False) == path
    assert path.read_text().splitlines() == lines


def test_generated_corpus_stops_at_its_time_limit_and_a_rerun_continues_to_the_same_file(tmp_path):
    from draftsmith.data.corpus import generate_corpus
    from draftsmith.sampling.load import load_model, load_tokenizer

    tok, target = load_tokenizer("tiny-random"), load_model("tiny-random", "fp32")
    prompts = ["def a():", "import os", "class B:"]
    kw = dict(samples_per_prompt=2, max_new_tokens=8, batch_size=2, progress=False)
    capped, whole = tmp_path / "capped.jsonl", tmp_path / "whole.jsonl"
    generate_corpus(target, tok, prompts, capped, max_seconds=0, **kw)
    assert len(capped.read_text().splitlines()) == 2  # one batch, then the limit
    generate_corpus(target, tok, prompts, capped, max_seconds=0, **kw)
    assert len(capped.read_text().splitlines()) == 4
    generate_corpus(target, tok, prompts, capped, **kw)
    generate_corpus(target, tok, prompts, whole, **kw)
    assert capped.read_text() == whole.read_text() and len(whole.read_text().splitlines()) == 6


def validations(run) -> list[int]:
    """Steps at which a run's CSV log holds a whole validation: the sampler's, on-target and held-out figures."""
    rows = [r for f in sorted((run / "csv").rglob("metrics.csv")) for r in csv.DictReader(f.open())]
    need = ("val/alpha", "val/alpha_on_target", "val/alpha_analytic", "val/loss")
    return sorted({int(r["step"]) for r in rows if all(r.get(k) for k in need)})


@pytest.mark.slow
def test_ddp_two_processes_sample_once_and_train_on_identical_blocks_across_a_resume(tmp_path, monkeypatch):
    """DDP on 2 CPU processes (gloo) with a time-boxed target-sampled corpus: rank 0 samples it once, rank 1 waits
    for its record and reads the same rows, so both train on identical blocks; a resume reads the record again and
    samples nothing (each rank used to find the time box unfinished and sample into the same file)."""
    monkeypatch.setenv("DRAFTSMITH_HOME", str(tmp_path / "home"))  # sampled here, not read from a cache
    run = tmp_path / "run"
    args = ("recipe=smoke", "trainer=ddp", "data=generated", "data.generated.n_prompts=40",
            "data.generated.samples_per_prompt=20", "data.generated.max_new_tokens=48", "data.max_documents=null",
            "data.generated.batch_size=8", "data.generated.max_minutes=0.02",
            f"hydra.run.dir={run}", "logger=csv")
    digests = re.compile(r"rank (\d+) trains on (\d+) blocks of (\S+), sha256 (\w+)")

    first = run_entry(*args)
    out = first.stdout + first.stderr
    assert first.returncode == 0, first.stderr[-3000:]
    assert "distributed_backend=gloo" in out and (run / "report.json").is_file()
    ranks = {r: (n, src, h) for r, n, src, h in digests.findall(first.stdout)}
    assert set(ranks) == {"0", "1"} and ranks["0"] == ranks["1"], ranks
    assert out.count("min spent (data.generated.max_minutes)") == 1  # the time box ended sampling, in one process
    sampled = len(next((tmp_path / "home" / "generated").glob("*.jsonl")).read_text().splitlines())
    record = json.loads((run / "data.json").read_text())
    assert record["rows"] == sampled < 800 and record["source"] == ranks["0"][1]  # cut by the time box
    # every block has the target's kept logits: rank 1 trains without the target, rank 0 validates for both
    assert "rank 1 holds no target" in first.stdout
    assert validations(run) == [2, 5]  # each with the held-out figures rank 1 could not measure

    again = run_entry(*args, "ckpt_path=last", "trainer.max_steps=9", "target.ranks=all")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "rank 1 holds a replica of the target: target.ranks=all" in again.stdout
    resumed = {r: (n, src, h) for r, n, src, h in digests.findall(again.stdout)}
    assert resumed == ranks, (resumed, ranks)  # the same blocks on both ranks as before the resume
    assert "target-generated corpus" not in again.stderr  # no progress bar: nothing sampled
    assert len(next((tmp_path / "home" / "generated").glob("*.jsonl")).read_text().splitlines()) == sampled


@pytest.mark.slow
def test_ddp_run_with_one_rank_killed_resumes_from_last_on_the_same_blocks(tmp_path):
    """SIGKILL rank 1 of a 2-process DDP run after its first checkpoint: rank 0 stops with an error within seconds
    (its next collective finds the peer gone) instead of hanging, and `ckpt_path=last` trains both ranks on to
    max_steps from the killed run's step, on the blocks the killed run trained on."""
    import signal
    import time

    run = tmp_path / "run"
    args = ("recipe=smoke", "trainer=ddp", "trainer.max_steps=12", "trainer.val_check_interval=4",
            f"hydra.run.dir={run}", "logger=csv")
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline")
    log = tmp_path / "first.log"
    proc = subprocess.Popen([sys.executable, str(ROOT / "train" / "draft.py"), *args], cwd=ROOT, env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    last = run / "checkpoints" / "last.ckpt"
    while not last.exists() and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before a rank could be killed"
    rank1 = [k for k in _children(proc.pid) if b"LOCAL_RANK=1" in (Path("/proc") / str(k) / "environ").read_bytes()]
    assert len(rank1) == 1, rank1
    os.kill(rank1[0], signal.SIGKILL)
    try:
        assert proc.wait(timeout=120) != 0
    finally:
        proc.kill()
    killed_at = torch.load(last, weights_only=True)["global_step"]
    assert 0 < killed_at < 12
    digests = re.compile(r"rank (\d+) trains on (\d+) blocks of (\S+), sha256 (\w+)")
    before = dict((r, h) for r, _, _, h in digests.findall(log.read_text()))

    again = run_entry(*args, "ckpt_path=last")
    assert again.returncode == 0, again.stderr[-3000:]
    after = dict((r, h) for r, _, _, h in digests.findall(again.stdout))
    assert set(after) == {"0", "1"} and after == before, (before, after)
    assert torch.load(last, weights_only=True)["global_step"] == 12
    steps = sorted({int(r["step"]) for f in (run / "csv").rglob("metrics.csv") for r in csv.DictReader(f.open())
                    if r.get("train/loss")})
    assert steps[-1] == 11 and set(range(killed_at, 12)) <= set(steps)  # CSV steps are 0-based


def _children(pid: int) -> list[int]:
    """The process ids whose parent is `pid` (Lightning's launcher starts rank 1 as a child of rank 0)."""
    kids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(d.name))
            except (OSError, ValueError):
                pass
    return kids


@pytest.mark.slow
def test_an_optuna_sweep_of_two_trials_maximises_what_main_returns(tmp_path):
    """`hparams_search=alpha_optuna -m`: two tiny trials, each a whole run; the study's best value is the best
    trial's best val/alpha_on_target, as each trial's report recorded it."""
    import yaml

    sweep = tmp_path / "sweep"
    res = run_entry("recipe=smoke", "hparams_search=alpha_optuna", f"hydra.sweep.dir={sweep}", "logger=csv")
    assert res.returncode == 0, res.stderr[-3000:]
    scores = [json.loads((sweep / str(i) / "report.json").read_text())["best_score"] for i in (0, 1)]
    result = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert result["best_value"] == pytest.approx(max(scores))
    assert set(result["best_params"]) == {"optim.lr", "loss", "draft.layers", "data.on_policy_fraction"}
