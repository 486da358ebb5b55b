"""Experiment tracking: the loggers a run writes to (CSV always, W&B when configured)."""

from __future__ import annotations

import os
from pathlib import Path

from draftsmith.sampling.machine import wandb_mode, write_text


def loggers(cfg, out_dir: Path | None = None) -> list:
    """The `logger` group's entries, each built by its `_target_` (an entry set to null, or left without a `_target_`
    by a recipe's settings for a logger the chosen group does not have, is off)."""
    from hydra.utils import instantiate

    built = [instantiate(spec) for spec in (cfg.get("logger") or {}).values() if spec and "_target_" in spec]
    return [lg for lg in built if lg is not None]


def wandb_logger(save_dir, project: str = "draftsmith", entity: str | None = None, group: str | None = None,
                 tags=(), mode: str = "auto", **kwargs):
    """Lightning's WandbLogger for the run directory `save_dir`: its id kept there (a resumed run logs to the same
    W&B run), the mode resolved so it never blocks (`wandb_mode`); None when disabled."""
    from lightning.pytorch.loggers import WandbLogger

    mode = wandb_mode(mode)
    if mode == "disabled":
        return None
    os.environ["WANDB_MODE"] = mode  # WandbLogger(offline=True) would set the legacy "dryrun" instead
    return WandbLogger(project=project, entity=entity, group=group, tags=list(tags or []), save_dir=str(save_dir),
                       name=Path(save_dir).name, id=run_id(save_dir),
                       settings=kwargs.pop("settings", {"init_timeout": 60, "silent": True}), **kwargs)


def run_id(out_dir: Path) -> str:
    """The W&B run id of this run directory, made once (OUT_DIR/wandb_id): `ckpt_path=last` continues the same W&B
    run (Lightning's WandbLogger resumes an id it is given) instead of starting a new one."""
    import uuid

    from draftsmith.train.data import first_rank

    path = Path(out_dir) / "wandb_id"
    if not path.is_file():
        if not first_rank():  # only rank 0 logs to W&B
            return None
        write_text(path, uuid.uuid4().hex[:12])
    return path.read_text().strip()


def wandb_runs(loggers: list) -> list:
    """The W&B runs among a trainer's loggers (started on first use)."""
    from lightning.pytorch.loggers import WandbLogger

    return [lg.experiment for lg in loggers if isinstance(lg, WandbLogger)]


def log_config(loggers: list, cfg, **extra) -> None:
    """The whole resolved config, and what it ran on, into every logger's hyperparameters (W&B's run config)."""
    from omegaconf import OmegaConf

    for lg in loggers:
        lg.log_hyperparams({"config": OmegaConf.to_container(cfg, resolve=True), **extra})


def log_tables(loggers: list, step: int, tables: dict[str, tuple[list[str], list[list]]]) -> None:
    """{key: (columns, rows)} as W&B tables at `step` (validation's acceptance by position, tokens per call by K)."""
    runs = wandb_runs(loggers)
    if not runs:  # wandb is imported only for a W&B logger: a run with logger=csv needs no wandb installed
        return
    import wandb

    for run in runs:
        # W&B's own step is Lightning's business (it logs `trainer/global_step` beside each metric); a step= here
        # behind W&B's would drop the tables
        run.log({**{k: wandb.Table(columns=cols, data=rows) for k, (cols, rows) in tables.items()},
                 "trainer/global_step": step})


def log_draft(loggers: list, draft_dir: Path, metadata: dict) -> None:
    """The best draft as a W&B model artifact of the run (alias `best`): the run's files and its model together."""
    runs = wandb_runs(loggers)
    if not runs:  # as in log_tables: no W&B logger, no wandb import
        return
    import wandb

    for run in runs:
        art = wandb.Artifact(f"draft-{run.id}", type="model", metadata=metadata)
        art.add_dir(str(draft_dir))
        run.log_artifact(art, aliases=["best"])


