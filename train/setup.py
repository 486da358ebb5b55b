"""The pieces `train/draft.py` assembles: output dir, loggers, data loaders, validation prompts."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset


class SetupError(ValueError):
    pass


def check_writable(out_dir: str) -> Path:
    path = Path(out_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write_probe_{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise SetupError(f"output directory {path} is not writable ({e.strerror}); set hydra.run.dir=<writable dir>")
    return path


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


def loaders(blocks: dict, cfg) -> tuple[DataLoader, DataLoader]:
    d = cfg.data
    train = DataLoader(TensorDataset(blocks["train"]), batch_size=d.batch_size, shuffle=True, drop_last=True,
                       num_workers=d.num_workers, generator=torch.Generator().manual_seed(cfg.seed))
    val = blocks["val"][: d.val_blocks]
    return train, DataLoader(TensorDataset(val), batch_size=d.batch_size, num_workers=d.num_workers)


def validation_prompts(blocks: dict, n: int, prompt_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Openings of held-out blocks (never trained on) as sampler prompts: (n, prompt_tokens) ids and mask."""
    val = blocks["val"]
    n = min(n, len(val))
    idx = torch.linspace(0, len(val) - 1, n).long()
    ids = val[idx, :prompt_tokens].clone()
    return ids, torch.ones_like(ids)
