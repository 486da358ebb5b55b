"""speculators' own trainer (`speculators train`, 0.9.0) on a CPU, in one process: run by its venv's python
(`peers.py`); it imports no draftsmith and patches no file of speculators'. Every argument after the script's name
is speculators' own command line, unchanged.

speculators assumes an accelerator in four places; each is replaced here, at import time, by what a CPU needs:
- the model and every batch go to `get_local_rank()`, the int 0, which torch reads as cuda:0: the trainer module's
  name now answers "cpu";
- autocast runs on `torch.accelerator.current_accelerator()`'s type, or "cuda" when there is none: set to "cpu"
  after the trainer is built (fp32 hidden states make autocast a no-op there);
- its step timer calls `torch.accelerator.synchronize()`, which raises with no accelerator: a no-op when there is
  none (CPU work is synchronous);
- a resumed checkpoint loads onto `get_current_device()`, "cuda:0" with no accelerator: "cpu".
Its fused loss is a Triton kernel; the command line picks the eager one (`--loss-implementation eager`), so that
is not patched. And its `--max-steps` ends each epoch after that many steps but not the run (0.9.0's
`run_training` goes on through every epoch, one step each): the run stops here after the epoch that reaches it,
once that epoch's checkpoint and validation are done. The names patched are 0.9.0's: a moved one fails loudly.
"""

from __future__ import annotations

import os
import sys

import torch


class MaxSteps(Exception):
    """The run reached --max-steps: training is over."""


def patch() -> None:
    import speculators.train.checkpointer as checkpointer
    import speculators.train.trainer as trainer

    missing = [n for mod, n in ((trainer, "get_local_rank"), (trainer, "Trainer"), (checkpointer, "get_current_device"))
               if not hasattr(mod, n)] + [n for n in ("maybe_update_best", "train_epoch")
                                          if not hasattr(trainer.Trainer, n)]
    if missing:
        raise SystemExit(f"speculators moved {missing}: this launcher is written for speculators 0.9.0")
    update_best = trainer.Trainer.maybe_update_best

    def stop_at_max_steps(self, epoch, val_metrics):  # called last in each epoch of `run_training`
        update_best(self, epoch, val_metrics)
        if self.config.max_steps is not None and self.global_step >= self.config.max_steps:
            raise MaxSteps(self.global_step)

    trainer.Trainer.maybe_update_best = stop_at_max_steps
    if torch.accelerator.is_available():
        return  # a GPU: nothing else to change
    real_sync = torch.accelerator.synchronize
    torch.accelerator.synchronize = lambda *a, **k: (real_sync(*a, **k) if torch.accelerator.is_available()
                                                     else None)
    trainer.get_local_rank = lambda: "cpu"
    checkpointer.get_current_device = lambda: "cpu"
    init = trainer.Trainer.__init__

    def cpu_init(self, *a, **k):
        init(self, *a, **k)
        self.device_type = "cpu"

    trainer.Trainer.__init__ = cpu_init


def main(argv: list[str]) -> None:
    threads = int(os.environ.get("DRAFTSMITH_THREADS", "0") or 0)
    if threads:
        torch.set_num_threads(threads)
    patch()
    from speculators.train.cli import main as train
    from speculators.train.config import TrainConfig

    try:
        train(TrainConfig.resolve(argv))
    except MaxSteps as done:
        print(f"draftsmith: speculators stopped at --max-steps ({done.args[0]} steps)", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
