"""The training bar: one bar for the whole run, in steps or in the time box, with the best score so far.

Lightning's bar restarts at every epoch and counts epochs, which say nothing in a run bounded by steps or by
`trainer.max_time` with no epoch limit (it read `Epoch 4/-2`). This one runs over the run's bound: the time box's
seconds when there is one (a run ends there, whatever step it reached), else `max_steps`; its line names the step,
the time spent of the box, and the best `checkpoint.monitor` (val/alpha_on_target by default) so far.
"""

from __future__ import annotations

import time

from lightning.pytorch.callbacks import Timer, TQDMProgressBar


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class RunProgress(TQDMProgressBar):
    def __init__(self, monitor: str = "val/alpha_on_target", **kwargs):
        super().__init__(**kwargs)
        self.monitor = monitor
        self._box: float | None = None  # seconds of the time box, when the run has one
        self._t0 = 0.0

    def on_train_start(self, trainer, pl_module):
        super().on_train_start(trainer, pl_module)
        timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)
        left = timer.time_remaining("train") if timer is not None else None
        self._box = None if left is None else timer.time_elapsed("train") + left
        self._t0 = time.monotonic() - (timer.time_elapsed("train") if timer is not None else 0.0)
        bar = self.train_progress_bar
        bar.reset(total=round(self._box) if self._box else trainer.max_steps)
        bar.unit = "s" if self._box else "step"
        self._show(trainer, pl_module)

    def on_train_epoch_start(self, trainer, *_):
        pass  # one bar for the run: no restart at each epoch

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._show(trainer, pl_module)

    def on_train_epoch_end(self, trainer, pl_module):
        self._show(trainer, pl_module)

    def on_train_end(self, *_):
        if self.train_progress_bar is not None:
            self.train_progress_bar.close()

    def description(self, trainer) -> str:
        """`step 120/800`, or `step 120, 03:10 of the 16:00 time box`, and the best score so far."""
        elapsed = time.monotonic() - self._t0
        where = (f"step {trainer.global_step}, {_clock(elapsed)} of the {_clock(self._box)} time box" if self._box
                 else f"step {trainer.global_step}/{trainer.max_steps}")
        best = next((c.best_model_score for c in trainer.checkpoint_callbacks
                     if getattr(c, "monitor", None) == self.monitor and c.best_model_score is not None), None)
        return where + ("" if best is None else f", best {self.monitor} {float(best):.4f}")

    def _show(self, trainer, pl_module):
        bar = self.train_progress_bar
        if bar is None or bar.disable:
            return
        bar.n = min(bar.total, round(time.monotonic() - self._t0) if self._box else trainer.global_step)
        bar.set_description(self.description(trainer), refresh=False)
        bar.set_postfix(self.get_metrics(trainer, pl_module))
