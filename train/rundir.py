"""The run directory: writable, claimed by one run at a time, resumed from its own checkpoint, written atomically."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from draftsmith.data.diskfull import disk_full
from draftsmith.sampling.errors import DraftsmithError
from draftsmith.sampling.machine import atomic_path
from draftsmith.train.launch import detect


def check_writable(out_dir: str) -> Path:
    path = Path(out_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write_probe_{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise DraftsmithError(f"output directory {path} is not writable ({e.strerror}); set "
                              "hydra.run.dir=<writable dir>")
    return path


_CLAIMS = []  # the open lock files of the run dirs this process holds (closed by the kernel when it dies)


def claim_run_dir(path: Path) -> None:
    """One training run per run directory: a second run (or a resume) there while the first lives is refused.
    flock, so a run that was SIGKILLed leaves no stale claim; the job's other ranks, on any node, share rank 0's."""
    if not detect().first:
        return
    lock = open(path / ".run.lock", "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        raise DraftsmithError(f"{path} is in use by another training run (pid {lock.read().strip() or '?'}); "
                              "give this one its own hydra.run.dir, or wait for that run to end") from None
    lock.truncate(0)
    lock.write(str(os.getpid()))
    lock.flush()
    _CLAIMS.append(lock)


def resume_checkpoint(out_dir: Path, ckpt_path: str | None) -> str | None:
    """`ckpt_path=last` (or a path): the checkpoint to resume from, checked to load before any work; a truncated
    or corrupt file is refused naming it and the newest other checkpoint of the run that does load."""
    if not ckpt_path:
        return None
    ckpt_dir = Path(out_dir) / "checkpoints"
    path = ckpt_dir / "last.ckpt" if ckpt_path == "last" else Path(ckpt_path)
    if path.is_dir():  # DeepSpeed writes a checkpoint as a directory of shards, one per rank
        if not ((path / "latest").is_file() or any(path.glob("*/*model_states.pt"))):
            raise DraftsmithError(f"ckpt_path={ckpt_path}: {path} is a directory but not a DeepSpeed checkpoint (no "
                                  "'latest' file, no *model_states.pt): resume from this run's checkpoints/last.ckpt")
        return str(path)
    if not path.is_file():
        raise DraftsmithError(f"ckpt_path={ckpt_path}: {path} does not exist (resume with hydra.run.dir=<the run dir>)")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zip, bad pickle, a file that is not ours
        if "Weights only load failed" in str(e):  # weights_only refuses any object but tensors and plain data
            raise DraftsmithError(f"checkpoint {path} holds pickled objects beyond tensors: refused, nothing in it was "
                                  "run (draftsmith's checkpoints hold only tensors and plain data)") from None
        good = []
        for other in sorted(ckpt_dir.glob("*.ckpt"), key=lambda p: p.stat().st_mtime, reverse=True):
            if other == path:
                continue
            try:
                torch.load(other, map_location="cpu", weights_only=True)
                good.append(other)
                break
            except Exception:
                continue
        hint = f"; resume from the previous good one with ckpt_path={good[0]}" if good else ""
        raise DraftsmithError(f"checkpoint {path} is truncated or corrupt ({type(e).__name__}){hint}") from None
    state = ckpt.get("state_dict") if isinstance(ckpt, dict) else None
    if not state or "global_step" not in ckpt or not all(k.startswith("draft.") for k in state):
        raise DraftsmithError(f"checkpoint {path} is not a draftsmith training checkpoint (no Lightning state of a "
                              "draft): resume from this run's own checkpoints/last.ckpt")
    return str(path)


def partitioned(model) -> bool:
    """True when DeepSpeed ZeRO-3 holds this model's parameters in shards (each rank sees an empty tensor)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def sharded(module) -> str | None:
    """"zero3" or "fsdp" where the module's draft is split over the ranks (no rank can run it alone), else None."""
    from lightning.pytorch.strategies import FSDPStrategy

    if partitioned(module.draft):
        return "zero3"
    trainer = module._trainer
    return "fsdp" if trainer is not None and isinstance(trainer.strategy, FSDPStrategy) else None


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's torch checkpoint IO, written to a temporary name and renamed: a process killed mid-write leaves
    the previous checkpoint in place, never a truncated one under the real name."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        need = sum(t.numel() * t.element_size() for t in _tensors(checkpoint))
        with disk_full("checkpoint", path, need=need, then="the checkpoints written before are whole: free space "
                       "(older run directories, their checkpoints/) and resume with ckpt_path=last"), \
                atomic_path(path) as tmp:
            super().save_checkpoint(checkpoint, tmp, storage_options)


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)
