"""Data parallelism across ranks (2 gloo processes under torchrun, a real Lightning DDP fit)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_a_nonfinite_loss_on_one_rank_skips_the_step_on_every_rank_and_ranks_sample_their_own_rows(tmp_path):
    """Rank 1's loss is NaN at step 3 (planted): every rank skips that step together (Lightning refuses a None
    step with several ranks, and a rank that skipped its backward would leave the other in the all-reduce), the
    weights stay equal across ranks and do not move at that step, and training goes on. Each rank's on-policy rows
    are its own (one seed everywhere made every rank sample the same rows)."""
    worker = Path(__file__).resolve().parent / "ddp_worker.py"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          "29611", str(worker), str(tmp_path), "3"], capture_output=True, text=True, env=env,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["nonfinite"] == r1["nonfinite"] == 1
    assert r0["sums"] == r1["sums"] and len(r0["sums"]) == 6  # every step ran on both, and kept them equal
    sums = r0["sums"]
    # recorded after each step under the step count it reached: the NaN step (global step 3) ends at 4
    assert sums["4"] == sums["3"]  # it moved nothing
    assert sums["3"] != sums["2"] and sums["5"] != sums["4"]  # the steps around it did
    assert r0["sampled"] != r1["sampled"]
