"""A run without wandb: `logger=csv` needs no wandb installed (the GPU machine's image has none). Validation's tables
and the end of the run's model artifact go to W&B only, and wandb is imported only when a W&B logger is there."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# on PYTHONPATH, a sitecustomize under which wandb looks not installed: every finder on sys.meta_path is wrapped so
# that neither the module nor its distribution metadata is found (what transformers and Lightning probe)
BLOCKER = '''import sys


class _NoWandb:
    def __init__(self, inner):
        self.inner = inner

    def find_spec(self, name, path=None, target=None):
        if name == "wandb" or name.startswith("wandb."):
            return None
        find = getattr(self.inner, "find_spec", None)
        return find(name, path, target) if find else None

    def find_distributions(self, *args, **kwargs):
        find = getattr(self.inner, "find_distributions", None)
        return [d for d in (find(*args, **kwargs) if find else []) if (d.metadata["Name"] or "").lower() != "wandb"]

    def __getattr__(self, name):
        return getattr(self.inner, name)


sys.meta_path[:] = [_NoWandb(f) for f in sys.meta_path]
'''


def test_csv_logging_never_imports_wandb(tmp_path, monkeypatch):
    """log_tables (every validation) and log_draft (the end of a run) with only a CSV logger, wandb unimportable."""
    from lightning.pytorch.loggers import CSVLogger

    from draftsmith.train import tracking

    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    csv = [CSVLogger(str(tmp_path))]
    tracking.log_tables(csv, 3, {"val/acceptance_by_position": (["position", "alpha"], [[1, 0.5]])})
    (tmp_path / "draft").mkdir()
    tracking.log_draft(csv, tmp_path / "draft", {"alpha": 0.5})
    with pytest.raises(ImportError):
        import wandb  # noqa: F401  (the block is real: the calls above would have met it)


def test_a_smoke_run_trains_to_its_end_with_wandb_unimportable(tmp_path):
    """recipe=smoke with logger=csv through validation and the end of the run, wandb blocked from import."""
    (tmp_path / "block").mkdir()
    (tmp_path / "block" / "sitecustomize.py").write_text(BLOCKER)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline",
               PYTHONPATH=os.pathsep.join([str(tmp_path / "block"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    probe = subprocess.run([sys.executable, "-c", "import importlib.metadata as m, importlib.util as u, wandb"],
                           env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "No module named 'wandb'" in probe.stderr
    probe = subprocess.run([sys.executable, "-c", "import importlib.metadata as m; m.version('wandb')"], env=env,
                           capture_output=True, text=True)
    assert "PackageNotFoundError" in probe.stderr
    res = subprocess.run([sys.executable, str(ROOT / "train" / "draft.py"), "recipe=smoke", "logger=csv",
                          f"hydra.run.dir={tmp_path / 'run'}"], env=env, capture_output=True, text=True, timeout=600,
                         cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "best draft:" in res.stdout
    assert (tmp_path / "run" / "report.json").is_file()
