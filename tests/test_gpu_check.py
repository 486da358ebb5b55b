"""The GPU check as far as a CPU machine can take it: it refuses here in one line, the 8B-shape target it trains
against is a shape with random weights, and its wheels fit what a working tree may carry to the GPU machine."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_the_gpu_check_refuses_without_cuda_in_one_line(tmp_path):
    res = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path)], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip().count("\n") == 0 and "no CUDA device" in res.stderr


def test_a_random_target_is_its_shape_with_random_weights(tmp_path, monkeypatch):
    """`random:SHAPE:LAYERS`: the shape's config cut to LAYERS layers, random weights, tiny-random's tokenizer; its
    config is read without building it (`config_of`, for plan=true)."""
    from draftsmith.sampling import load

    shape = tmp_path / "shape"
    shape.mkdir()
    (shape / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2}))
    monkeypatch.setitem(load.ALIASES, "tiny-shape", load._Shape(str(shape)))  # an absolute folder
    monkeypatch.setenv("DRAFTSMITH_HOME", str(tmp_path / "home"))
    assert load.config_of("random:tiny-shape:2").num_hidden_layers == 2
    assert not (tmp_path / "home" / "models").exists() or not any((tmp_path / "home" / "models").glob("random*"))
    model, tok = load.load_model("random:tiny-shape:2", "fp32"), load.load_tokenizer("random:tiny-shape:2")
    assert model.config.num_hidden_layers == 2 and model.config.vocab_size == 1000 and len(tok) == 512
    assert model.config.eos_token_id == tok.eos_token_id
    with pytest.raises(load.DraftsmithError, match="random:SHAPE or random:SHAPE:LAYERS"):
        load.resolve("random:tiny-shape:x")


@pytest.mark.slow
def test_the_gpu_checks_wheels_fit_a_working_tree(tmp_path):
    """scripts/fetch_gpu_wheels.sh (from PyPI): every wheel for Python 3.12 on x86-64, draftsmith's own among them,
    64 MiB at most together."""
    res = subprocess.run(["bash", str(ROOT / "scripts" / "fetch_gpu_wheels.sh"), str(tmp_path)], capture_output=True,
                         text=True, timeout=900, env=dict(os.environ))
    assert res.returncode == 0, res.stderr[-2000:]
    wheels = {p.name.split("-")[0].lower() for p in tmp_path.glob("*.whl")}
    assert {"draftsmith", "hydra_core", "omegaconf", "deepspeed", "datasets", "transformers"} <= wheels
    assert sum(p.stat().st_size for p in tmp_path.glob("*.whl")) <= 64 * 2**20
    print(res.stdout.strip())
