"""Damaged and hostile inputs are refused in one line, before anything runs: NaN/Inf weights, checkpoints that ask
to run their own code, a non-finite training loss, a feature draft asked for what it cannot do."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_cli import cli

from draftsmith.sampling.errors import DraftsmithError
from draftsmith.sampling.load import load_model
from draftsmith.sampling.names import resolve


@pytest.fixture()
def tiny_copy(tmp_path):
    src = resolve("tiny-random")
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def test_nan_weights_are_refused_by_loader_and_cli(tiny_copy):
    path = tiny_copy / "model.safetensors"
    state = load_file(path)
    name = next(k for k in state if "layers.1.mlp" in k)
    state[name][0, 0] = float("nan")
    save_file(state, path, metadata={"format": "pt"})
    with pytest.raises(DraftsmithError, match=f"weight .*{name.split('.')[-2]}.* NaN or Inf"):
        load_model(str(tiny_copy), "fp32")
    res = cli("--draft", str(tiny_copy), "--prompt", "def f(x):", "--max-new-tokens", "4")
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 2 and last.startswith("error: ") and "NaN or Inf" in last


def test_remote_code_is_refused_unless_trusted(tiny_copy):
    cfg = json.loads((tiny_copy / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (tiny_copy / "config.json").write_text(json.dumps(cfg))
    (tiny_copy / "modeling_evil.py").write_text("raise SystemExit('remote code ran')\n")
    with pytest.raises(DraftsmithError, match="asks to run its own Python code"):
        load_model(str(tiny_copy), "fp32")
    res = cli("--draft", str(tiny_copy), "--prompt", "x", "--max-new-tokens", "2")
    assert res.returncode == 2 and "--trust-remote-code" in res.stderr and "remote code ran" not in res.stderr


def test_generate_k_auto_and_feature_draft_refusals(tmp_path):
    from conftest import tiny_llama  # noqa: F401  (conftest sets threads)
    from test_feature import feature_draft

    from draftsmith.sampling.load import load_tokenizer

    target = load_model("tiny-random", "fp32")
    draft = feature_draft(target, scale=1.0)
    draft.save_pretrained(tmp_path / "f")
    load_tokenizer("tiny-random").save_pretrained(tmp_path / "f")
    ok = cli("--draft", str(tmp_path / "f"), "--prompt", "def f(x):", "--max-new-tokens", "10", "-k", "auto", "--json")
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert json.loads(ok.stdout)["stats"]["k_per_loop"]
    bad = cli("--draft", str(tmp_path / "f"), "--prompt", "x", "--draft-vocab", "64")
    assert bad.returncode == 2 and "feature draft's head is chosen in training" in bad.stderr
    from draftsmith.sampling.generate import _k

    with pytest.raises(ValueError, match="'auto'"):
        _k("two")


def test_nonfinite_loss_skips_steps_then_stops():
    """A NaN loss: the step is skipped (no backward, no update) and counted; five in a row stop the run."""
    from conftest import tiny_llama

    from draftsmith.train.module import DraftModule

    target, draft = tiny_llama(vocab=20), tiny_llama(vocab=20, layers=1, seed=1)
    module = DraftModule(draft, target, loss={"weights": {"ce": 1.0}, "distill": False, "compile": False},
                         optim={"lr": 1e-3}, sampler={"temperature": 1.0}, max_steps=10)
    module.log = lambda *a, **k: None  # no trainer attached
    before = {k: v.clone() for k, v in draft.state_dict().items()}
    ids = torch.randint(0, 20, (2, 8))
    import draftsmith.train.module as m

    real = m.draft_loss
    m.draft_loss = lambda *a, **k: (torch.tensor(float("nan"), requires_grad=True), {})
    try:
        for _ in range(4):
            assert module.training_step(ids, 0) is None
        with pytest.raises(DraftsmithError, match="NaN or Inf for 5 steps in a row"):
            module.training_step(ids, 0)
    finally:
        m.draft_loss = real
    assert module.nonfinite_steps == 5
    assert all(torch.equal(v, before[k]) for k, v in draft.state_dict().items())


def test_checkpoint_survives_sigkill_mid_write(tmp_path):
    """A process rewriting a 100 MB checkpoint is SIGKILLed while a write is in flight: the checkpoint under the
    real name still loads (the previous one), never a truncated file."""
    import signal
    import subprocess
    import sys
    import time

    from draftsmith.train.rundir import AtomicCheckpointIO

    path = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"global_step": 0}, path)
    code = ("import torch, sys; from draftsmith.train.rundir import AtomicCheckpointIO; io = AtomicCheckpointIO(); x = "
            "torch.randn(25_000_000)\nfor i in range(1, 1000): io.save_checkpoint({'global_step': i, 'x': x}, "
            "sys.argv[1])")
    proc = subprocess.Popen([sys.executable, "-c", code, str(path)])
    t0, biggest = time.time(), 0
    while time.time() - t0 < 60:  # until a write is in flight: a partial file, or the real one being rewritten
        size = path.stat().st_size if path.exists() else 0
        if list(tmp_path.glob(".last.ckpt.*partial")) or size < biggest:
            break
        biggest = max(biggest, size if size > 10_000_000 else 0)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert time.time() - t0 < 60
    assert "global_step" in torch.load(path, weights_only=True)


def test_crafted_and_foreign_checkpoints_are_refused_never_run(tmp_path):
    """ckpt_path= a pickle that would run a command when unpickled: refused in one line, the command never runs;
    a torch file that is not a draft's Lightning checkpoint: refused in one line before Lightning sees it."""
    import os
    import pickle

    from draftsmith.sampling.errors import DraftsmithError
    from draftsmith.train.rundir import resume_checkpoint

    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    crafted = tmp_path / "crafted.ckpt"
    torch.save({"state_dict": {}, "global_step": 1, "x": Payload()}, crafted, pickle_module=pickle)
    with pytest.raises(DraftsmithError, match="holds pickled objects beyond tensors: refused, nothing in it was run"):
        resume_checkpoint(tmp_path, str(crafted))
    assert not marker.exists()
    foreign = tmp_path / "foreign.ckpt"
    torch.save({"model": {"w": torch.zeros(2)}}, foreign)
    with pytest.raises(DraftsmithError, match="is not a draftsmith training checkpoint"):
        resume_checkpoint(tmp_path, str(foreign))
    ours = tmp_path / "ours.ckpt"
    torch.save({"state_dict": {"draft.w": torch.zeros(2)}, "global_step": 3}, ours)
    assert resume_checkpoint(tmp_path, str(ours)) == str(ours)


def test_resume_from_a_truncated_checkpoint_names_the_good_one(smoke_run, tmp_path):
    from conftest import run_entry

    out, _ = smoke_run
    run = tmp_path / "run"
    shutil.copytree(out, run)
    last = run / "checkpoints" / "last.ckpt"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    res = run_entry("recipe=smoke", f"hydra.run.dir={run}", "ckpt_path=last", "logger=csv")
    line = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 2 and "last.ckpt is truncated or corrupt" in line and "ckpt_path=" in line
    assert "step" in line.split("ckpt_path=")[-1]  # the best checkpoint of the run, which loads


@pytest.mark.parametrize("damage, message", [
    (lambda d: open(d / "model.safetensors", "r+b").truncate(1000), "model.safetensors is not a readable safetensors"),
    (lambda d: open(d / "model.safetensors", "r+b").truncate((d / "model.safetensors").stat().st_size - 64),
     "model.safetensors is truncated or damaged"),
    (lambda d: (d / "config.json").write_text("{not json"), "config.json is not readable JSON"),
    (lambda d: (d / "tokenizer.json").write_bytes(b"\x00\xff binary"), "the tokenizer files are not readable"),
], ids=["safetensors-header", "safetensors-cut", "config", "tokenizer"])
def test_damaged_checkpoint_files_are_named(tiny_copy, damage, message):
    from draftsmith.sampling.load import load_tokenizer

    damage(tiny_copy)
    with pytest.raises(DraftsmithError, match=message) as e:
        load_model(str(tiny_copy), "fp32")
        load_tokenizer(str(tiny_copy))
    assert str(tiny_copy) in str(e.value) and "\n" not in str(e.value)


def test_truncated_gguf_is_refused_before_conversion(tmp_path):
    import numpy as np
    from gguf import GGUFWriter

    from draftsmith.sampling.machine import cache_home

    f = tmp_path / "m.gguf"
    w = GGUFWriter(str(f), "llama")
    w.add_tensor("token_embd.weight", np.ones((64, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size - 1024)
    with pytest.raises(DraftsmithError, match="m.gguf is (truncated|not a readable GGUF)"):
        load_model(str(f), "fp32")
    assert not (cache_home() / "models" / "m").exists()  # nothing written


@pytest.mark.parametrize("name, data, message", [
    ("bad.txt", b"ok\n\xff\xfe\x80 not utf-8\n", "UnicodeDecodeError"),
    ("bad.jsonl", b'{"text": "ok"}\n{"text": \n', "as json"),
    ("cut.parquet", b"PAR1 not really a parquet file", "as parquet"),
])
def test_damaged_corpus_files_are_named(tmp_path, name, data, message):
    from draftsmith.data.corpus import _documents
    from draftsmith.sampling.errors import DraftsmithError

    (tmp_path / name).write_bytes(data)
    with pytest.raises(DraftsmithError, match=message) as e:
        _documents(str(tmp_path / name), "text", None)
    assert name in str(e.value) and "\n" not in str(e.value)


def test_a_parquet_without_the_text_field_is_named_and_an_empty_jsonl_line_loses_nothing(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from draftsmith.data.corpus import _documents
    from draftsmith.sampling.errors import DraftsmithError

    pq.write_table(pa.table({"content": ["def f(): pass", "x = 1"]}), tmp_path / "code.parquet")
    with pytest.raises(DraftsmithError, match=r"code.parquet has no 'text' column \(it has \['content'\]\); "
                                          "set data.text_field"):
        _documents(str(tmp_path / "code.parquet"), "text", None)
    assert _documents(str(tmp_path / "code.parquet"), "content", None) == ["def f(): pass", "x = 1"]
    (tmp_path / "gap.jsonl").write_text('{"text": "first"}\n\n{"text": "second"}\n')
    assert _documents(str(tmp_path / "gap.jsonl"), "text", None) == ["first", "second"]


def test_one_error_type_is_raised_by_every_layer_and_no_module_defines_another():
    """A library user catches DraftsmithError alone: a refusal of the sampler, the trainer, an engine and the deploy
    path is one, DiskFull is also an OSError (ENOSPC) and MissingExtra an ImportError; and no module grows a family
    of its own again (SetupError, CorpusError, ExportError, BundleError, ModelNotFound, EngineError, ... before)."""
    import ast
    import errno
    from pathlib import Path

    from conftest import ROOT

    from draftsmith.data.diskfull import DiskFull
    from draftsmith.deploy.export import locate
    from draftsmith.engines import open_engine
    from draftsmith.train import MissingExtra
    from draftsmith.train.rundir import check_writable

    raised = []
    for refuse in (lambda: resolve("no-such-model.gguf"), lambda: locate(Path("/nonexistent-run"), None),
                   lambda: open_engine("no-such-engine", None), lambda: check_writable("/proc/draftsmith-run")):
        with pytest.raises(DraftsmithError) as e:
            refuse()
        raised.append(type(e.value))
    assert raised == [DraftsmithError] * 4
    full = DiskFull("disk full: could not write x to y")
    assert isinstance(full, DraftsmithError) and isinstance(full, OSError) and full.errno == errno.ENOSPC
    extra = MissingExtra("train", ["lightning"])
    assert isinstance(extra, DraftsmithError) and isinstance(extra, ImportError) and extra.name == "lightning"

    allowed = {"DraftsmithError", "DiskFull", "MissingExtra"}
    # scripts that run in a peer's own venv and import no draftsmith: what they raise never reaches a library user
    elsewhere = {"deploy/bench/peer_speculators.py": "speculators' venv; its MaxSteps ends the run inside main()"}
    defined = set()
    for layer in ("sampling", "engines", "data", "drafts", "train", "deploy"):
        for path in (ROOT / layer).rglob("*.py"):
            if str(path.relative_to(ROOT)) in elsewhere:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef) and any(
                        getattr(b, "id", getattr(b, "attr", "")).endswith(("Error", "Exception", "NotFound"))
                        for b in node.bases):
                    defined.add(f"{path.relative_to(ROOT)}:{node.name}")
    assert {d.split(":")[1] for d in defined} <= allowed, sorted(defined)
