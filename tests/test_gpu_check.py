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


def test_the_sampler_bench_measures_c_and_v_without_compile(tmp_path, capsys):
    """The GPU check's cost rows come from `bench sampler` without --compile: every draft but the target itself gets
    its c and v(K) measured eagerly, the paper-shaped draft among them (before, only --compile measured any)."""
    from draftsmith.deploy.bench import sampler

    out = tmp_path / "bench.json"
    assert sampler.main(["--target", "tiny-random", "--device", "cpu", "--dtype", "fp32", "--cut-layers", "1",
                         "--paper-draft", "--prompts", "1", "--max-new-tokens", "4", "-k", "2", "--json",
                         str(out)]) == 0
    costs = json.loads(out.read_text())["costs"]
    assert set(costs) == {"cut", "paper"}
    assert all(c["c"] > 0 and set(c["v"]) == {"1", "2"} for c in costs.values())
    printed = capsys.readouterr().out
    assert "ours_sps_self" in printed and "ours_sps_paper" in printed
    assert [ln.split()[0] for ln in printed.splitlines() if " c=" in ln] == ["cut", "paper"]


def test_the_demo_shape_is_the_demo_targets_config():
    """`random:smollm2-135m-shape`: the demo target's shape (SmolLM2-135M-Instruct) for its c and v(K) on a GPU,
    where its 93 MB of weights cannot be carried."""
    from draftsmith.sampling.load import config_of

    c = config_of("random:smollm2-135m-shape")
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.vocab_size) == (30, 576, 1536, 49152)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.tie_word_embeddings) == (9, 3, 64, True)
