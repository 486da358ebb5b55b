"""draftsmith installs as one package: `pip install .` (a wheel, not the checkout) puts `draftsmith` and nothing
named `train`, `sampling` or `deploy` into site-packages, ships the recipes and prompts as package data, and the
main job runs from any directory, one holding a user's own `train.py` too, as `python -m draftsmith.train.draft`
under torchrun, srun and Lightning's own launcher."""

import os
import subprocess
import sys
import sysconfig

import pytest
from conftest import ROOT
from test_launch import free_port, srun_env

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
    # `python -m draftsmith.train.draft` from the wheel under each launcher the docs show: torchrun, srun (its
    # variables, two tasks) and Lightning's own (it starts rank 1 by running the module again), two ranks each
    quick = ["recipe=smoke", "trainer=ddp", "trainer.max_steps=2", "trainer.val_check_interval=2",
             "eval.baseline=false", "logger=csv"]
    entry = [str(py), "-m", "draftsmith.train.draft", *quick]
    env1 = dict(env, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="offline")
    port = free_port(15000, 25000)
    runs = {"torchrun": [([str(py), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                          "draftsmith.train.draft", *quick, f"hydra.run.dir={work / 'torchrun'}"], env1)],
            "srun": [([*entry, "trainer.devices=1", "trainer.num_nodes=2", f"hydra.run.dir={work / 'srun'}"],
                      {**srun_env(i, 2, port), "PYTHONPATH": "", "OMP_NUM_THREADS": "1"}) for i in (0, 1)],
            "lightning": [([*entry, f"hydra.run.dir={work / 'lightning'}"], env1)]}
    for launcher, commands in runs.items():
        procs = [subprocess.Popen(cmd, cwd=work, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for cmd, e in commands]
        outs = [p.communicate(timeout=900)[0] for p in procs]
        assert all(p.returncode == 0 for p in procs), (launcher, outs[0][-3000:], outs[-1][-3000:])
        assert f"launcher {launcher}, rank 1" in "".join(outs) and "world size 2" in outs[0], launcher
        assert (work / launcher / "best_draft" / "config.json").is_file(), launcher
    for verb in ("generate", "export", "deploy-check", "bench", "plan"):
        helped = subprocess.run([str(bin_dir / "draftsmith"), verb, "--help"], cwd=work, capture_output=True,
                                text=True, env=env)
        assert helped.returncode == 0 and "usage" in helped.stdout, verb + helped.stderr[-500:]
