"""SpecForge's own trainer (`specforge train`, 0.2.0) on a CPU, in one process: run by its venv's python
(`peers.py`) with SPECFORGE_DEVICE=cpu and TORCH_COMPILE_DISABLE=1; it imports no draftsmith and patches no file of
SpecForge's. Every argument after the script's name is SpecForge's own command line, unchanged.

What a CPU needs beyond its settings (`training.fsdp_sharding=NO_SHARD`, `training.attention_backend=sdpa`,
`data.dataloader_num_workers=0`):
- its EAGLE-3 loss is a Triton kernel launched on whatever tensors it gets, and Triton has no CPU driver: the
  module's `LogSoftmaxLoss` is replaced, at import time, by the same quantity in plain torch (the mean over
  positions of -sum_v mask * p_target(v) * log softmax(logits)(v), its own reference formula), autograd doing
  the backward;
- its draft's RMSNorm and RoPE are `torch.compile`d, which on a CPU needs inductor and a C++ toolchain:
  TORCH_COMPILE_DISABLE=1 (set here when unset).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("SPECFORGE_DEVICE", "cpu")
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

import torch  # noqa: E402


class TorchKL:
    """SpecForge's `LogSoftmaxLoss.apply(logits, target_p, position_mask)`, in torch."""

    @staticmethod
    def apply(logits, target_p, position_mask):
        logp = torch.log_softmax(logits.float(), dim=-1)
        return -(position_mask * target_p * logp).sum(-1).mean()


def patch() -> None:
    import specforge.algorithms.eagle3.model as model

    if not hasattr(model, "LogSoftmaxLoss"):
        raise SystemExit("specforge moved LogSoftmaxLoss: this launcher is written for specforge 0.2.0")
    if not torch.cuda.is_available():
        model.LogSoftmaxLoss = TorchKL


def main(argv: list[str]) -> int:
    threads = int(os.environ.get("DRAFTSMITH_THREADS", "0") or 0)
    if threads:
        torch.set_num_threads(threads)
    patch()
    from specforge.cli import main as cli

    return cli(argv) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
