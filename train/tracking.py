"""Experiment tracking: the loggers a run writes to (CSV always, W&B when configured)."""

from __future__ import annotations

import os
from pathlib import Path


def _wandb_mode(mode: str) -> str:
    """auto: online only when a key is configured (env or netrc); offline otherwise, so it never blocks."""
    if mode != "auto":
        return mode
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = Path.home() / ".netrc"
    if netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore"):
        return "online"
    return "offline"


def loggers(cfg, out_dir: Path) -> list:
    from lightning.pytorch.loggers import CSVLogger, WandbLogger

    out = []
    if cfg.logger.get("csv"):
        out.append(CSVLogger(str(out_dir), name="csv", version=""))
    wb = cfg.logger.get("wandb")
    if wb:
        mode = _wandb_mode(wb.get("mode", "auto"))
        if mode != "disabled":
            os.environ["WANDB_MODE"] = mode  # WandbLogger(offline=True) would set the legacy "dryrun" instead
            out.append(WandbLogger(project=wb.get("project", "draftsmith"), save_dir=str(out_dir),
                                   name=Path(out_dir).name, settings={"init_timeout": 60, "silent": True}))
    return out


