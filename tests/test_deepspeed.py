"""DeepSpeed ZeRO-2/3 engines on CPU with our recipes' configs, 2 gloo processes (the first run JIT-compiles
DeepSpeed's shm_comm op, about a minute on 2 cores)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True)
def _deepspeed_imports():
    """The dev extra installs DeepSpeed, so one that fails to import (a torch bump, say) fails these tests: an
    importorskip at module level skipped all three silently, past DRAFTSMITH_REQUIRE."""
    import deepspeed  # noqa: F401


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_engine_runs_on_cpu_with_our_config(tmp_path, stage):
    worker = Path(__file__).resolve().parent / "ds_worker.py"
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          str(29500 + stage), str(worker), str(stage), str(tmp_path)], capture_output=True, text=True,
                         env=env, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads((tmp_path / "result.json").read_text())
    assert out["world_size"] == 2 and out["stage"] == stage
    assert out["optimizer"] == ("DeepSpeedZeroOptimizer" if stage == 2 else "DeepSpeedZeroOptimizer_Stage3")
    assert out["losses"][-1] < out["losses"][0]
    assert list((tmp_path / "ckpt").rglob("*optim_states.pt"))
    # the run's checkpoint reader consolidates the shards into the whole weights; resume accepts the directory
    from safetensors.torch import load_file

    from draftsmith.drafts.saved import checkpoint_state
    from draftsmith.train.rundir import resume_checkpoint

    state, whole = checkpoint_state(tmp_path / "ckpt"), load_file(tmp_path / "whole.safetensors")
    assert set(whole) <= set(state)
    for k, v in whole.items():
        torch.testing.assert_close(state[k].float(), v, rtol=0, atol=0)
    assert resume_checkpoint(tmp_path, str(tmp_path / "ckpt")) == str(tmp_path / "ckpt")


@pytest.mark.slow
def test_a_pruned_head_trains_and_is_copied_under_zero3(tmp_path):
    """Under ZeRO-3 a weight read outside its owner's forward is an empty shard: the training step's pruned head
    (its rows read in a forward of their own, registered with DeepSpeed) trains, and the sampler's copy of the draft
    is made of plain tensors (a deep copy also copied DeepSpeed's hooks onto it)."""
    worker = Path(__file__).resolve().parent / "zero3_worker.py"
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          "29507", str(worker), str(tmp_path)], capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    for rank in (0, 1):
        r = json.loads((tmp_path / f"zero3_rank{rank}.json").read_text())
        assert r["shard"] < 32 * 32  # the head really is a shard outside its forward
        assert r["logits"] == [18, 6] and r["losses"][-1] < r["losses"][0]  # 2 x 9 positions over 6 rows
        assert r["plain"] and r["same"] and r["head"] == 6
