"""The ablation is a Hydra multirun (recipes/hparams_search/ablation.yaml); `draftsmith bench ablation` reads its
directory and writes the table, the JSON and the plot."""

import json
import subprocess
import sys

import pytest
from conftest import ROOT, run_entry

pytestmark = pytest.mark.slow


def test_the_ablation_grid_runs_as_a_multirun_and_its_table_and_plot_read_it(tmp_path):
    sweep = tmp_path / "multirun"
    res = run_entry("-m", "recipe=smoke", "hparams_search=ablation", "data=fixed", "loss=distill_tv",
                    "draft.layers=1,2", "trainer.max_time=00:00:00:10", f"hydra.sweep.dir={sweep}", "logger=csv")
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(p.name for p in sweep.iterdir() if (p / "report.json").is_file()) == ["0", "1"]
    out = tmp_path / "out"
    script = [sys.executable, "-m", "draftsmith.deploy.cli", "bench", "ablation", str(sweep), "--out", str(out)]
    res = subprocess.run(script, capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    runs = json.loads((out / "ablation.json").read_text())["runs"]
    assert [(r["data"], r["loss"], r["draft.layers"]) for r in runs] == [("fixed", "distill_tv", 1),
                                                                       ("fixed", "distill_tv", 2)]
    assert all(0 <= r["code_alpha_on_target"] <= 1 and r["c"] > 0 for r in runs)
    assert (out / "ablation.png").stat().st_size > 10_000 and "fixed-distill_tv-L2" in (out / "ablation.md").read_text()
    (sweep / "1" / "report.json").unlink()  # a job that failed or still runs: left out, and named
    res = subprocess.run(script, capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0 and "1 (" in res.stderr and "left out" in res.stderr
    assert len(json.loads((out / "ablation.json").read_text())["runs"]) == 1
    res = subprocess.run([*script[:5], str(tmp_path / "none")], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 2 and res.stderr.startswith("error: ") and "hparams_search=ablation" in res.stderr
