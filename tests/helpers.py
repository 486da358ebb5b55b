"""Shared statistical helpers for the exactness tests: the same chi-square that judges engines."""

from draftsmith.deploy.stats import chi2_pvalue  # noqa: F401


def fit_losses(module, blocks, tmp_path, steps: int = 6) -> list[float]:
    """A real Lightning fit of `module` on `blocks` (batches of 4, with their row indices, no validation): the
    train/loss of every step."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    seen = []
    module.log = lambda name, v, **kw: seen.append(float(v)) if name == "train/loss" else None
    data = DataLoader(TensorDataset(blocks, torch.arange(len(blocks))), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, default_root_dir=tmp_path, limit_val_batches=0)
    trainer.fit(module, data)
    return seen
