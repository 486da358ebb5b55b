"""draftsmith installs as one package: `pip install .` (a wheel, not the checkout) puts `draftsmith` and nothing
named `train`, `sampling` or `deploy` into site-packages, ships the recipes and prompts as package data, and the
main job runs from any directory, one holding a user's own `train.py` too: `python -m draftsmith.train.draft` under
torchrun, and the `draftsmith train` verb under Lightning's own launcher."""

import os
import subprocess
import sys
import sysconfig

import pytest
from conftest import ROOT

pytestmark = pytest.mark.slow


def test_wheel_installs_and_runs_the_smoke_recipe_outside_the_checkout(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(wheels), str(ROOT)], check=True, capture_output=True, text=True)
    (wheel,) = wheels.glob("draftsmith-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py, bin_dir = venv / "bin" / "python", venv / "bin"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True,
                   capture_output=True, text=True)
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # the dependencies (torch, lightning, ...) from this environment, as a plain path: its .pth files (our own
    # editable install among them) are not processed there, so only the wheel provides draftsmith
    (venv / site.split(str(venv) + "/")[1] / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    top = sorted(p.name for p in (venv / site.split(str(venv) + "/")[1]).iterdir())
    assert "draftsmith" in top and not {"train", "sampling", "deploy", "recipes"} & set(top), top

    work = tmp_path / "elsewhere"
    work.mkdir()
    (work / "train.py").write_text("raise SystemExit('the user train.py was imported')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = subprocess.run([str(py), "-c", "import draftsmith.train.draft as d; print(d.__file__, d.RECIPES)"],
                           cwd=work, capture_output=True, text=True, env=env)
    assert where.returncode == 0 and str(ROOT) not in where.stdout, where.stdout + where.stderr
    # the wheel under the two launchers that start rank 1 by running something of ours again: torchrun (`-m
    # draftsmith.train.draft` on each rank) and Lightning's own, through the `draftsmith train` verb (Lightning runs
    # the process' script again for rank 1, which must be the training entry and not the verb's command line). srun
    # runs the same `python -m` command on each node as it is given: its semantics are tests/test_launch.py's.
    quick = ["recipe=smoke", "trainer=ddp", "trainer.max_steps=2", "trainer.val_check_interval=2",
             "eval.baseline=false", "logger=csv"]
    env1 = dict(env, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="offline")
    runs = {"torchrun": [str(py), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                         "draftsmith.train.draft", *quick, f"hydra.run.dir={work / 'torchrun'}"],
            "lightning": [str(bin_dir / "draftsmith"), "train", *quick, f"hydra.run.dir={work / 'lightning'}"]}
    for launcher, cmd in runs.items():
        res = subprocess.run(cmd, cwd=work, env=env1, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             timeout=900)
        assert res.returncode == 0, (launcher, res.stdout[-3000:])
        assert f"launcher {launcher}, rank 1" in res.stdout and "world size 2" in res.stdout, launcher
        assert (work / launcher / "best_draft" / "config.json").is_file(), launcher
    for verb in ("generate", "export", "deploy-check", "bench", "plan"):
        helped = subprocess.run([str(bin_dir / "draftsmith"), verb, "--help"], cwd=work, capture_output=True,
                                text=True, env=env)
        assert helped.returncode == 0 and "usage" in helped.stdout, verb + helped.stderr[-500:]
