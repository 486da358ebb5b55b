"""The training bar shows what bounds a run: its steps, or its time box, and the best score so far."""

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from draftsmith.train.progress import RunProgress


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(4, 1)

    def training_step(self, batch, _):
        return self.w(batch[0]).pow(2).mean()

    def validation_step(self, batch, _):
        self.log("val/alpha_on_target", 0.25 + 0.01 * self.global_step)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit(tmp_path, **bound):
    data = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2)  # 4 batches an epoch: several epochs
    bar = RunProgress()
    trainer = L.Trainer(accelerator="cpu", logger=False, default_root_dir=tmp_path, val_check_interval=3,
                        check_val_every_n_epoch=None, num_sanity_val_steps=0, enable_model_summary=False,
                        callbacks=[bar, ModelCheckpoint(dirpath=tmp_path, monitor="val/alpha_on_target", mode="max")],
                        **bound)
    trainer.fit(Tiny(), data, data)
    return bar, trainer


def test_a_step_bounded_run_counts_its_steps_and_shows_the_best_score(tmp_path, capsys):
    bar, trainer = _fit(tmp_path, max_steps=10)
    assert bar.train_progress_bar.total == 10 and bar.train_progress_bar.n == 10  # one bar, not one an epoch
    assert bar.description(trainer) == "step 10/10, best val/alpha_on_target 0.3400"
    assert "Epoch" not in capsys.readouterr().err.split("Validation")[0]


def test_a_time_boxed_run_shows_its_box(tmp_path):
    bar, trainer = _fit(tmp_path, max_time="00:00:00:02", max_steps=-1)
    line = bar.description(trainer)
    assert bar.train_progress_bar.total == 2 and bar.train_progress_bar.unit == "s"
    assert line.startswith(f"step {trainer.global_step}, 00:0") and "of the 00:02 time box, best" in line
