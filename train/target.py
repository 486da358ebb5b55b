"""The frozen target in a run: the dtype and device it loads in, and which ranks hold it (a replica on every rank,
or rank 0 alone where training only reads its kept logits)."""

from __future__ import annotations

import torch

from draftsmith.sampling.errors import DraftsmithError
from draftsmith.sampling.precision import DTYPES, cuda_dtype
from draftsmith.sampling.precision import resolve as resolve_dtype
from draftsmith.sampling.runtime import prepared_model
from draftsmith.train.launch import (
    detect,
)


def load_target(cfg):
    """Rank 0's target may be spread over the node's GPUs (target.device_map=auto: a target no one GPU holds, there
    once for validation and the report); a replica on another rank sits on that rank's own device."""
    return prepared_model(cfg.target.name, cfg.target.dtype, role="teacher", device=target_device(cfg),
                      trust_remote_code=bool(cfg.target.trust_remote_code),
                      device_map=cfg.target.device_map if detect().first else None)


def target_device(cfg) -> str:
    """The target loads straight onto this rank's device in its CUDA dtype (no CPU probe, no CPU kernels): a GPU
    trainer's rank holds the GPU of its local rank on its node, a CPU trainer the CPU."""
    acc = str(cfg.trainer.get("accelerator", "cpu"))
    if acc in ("gpu", "cuda") or (acc == "auto" and torch.cuda.is_available()):
        return f"cuda:{detect().local_rank}"
    return "cpu"


def target_dtype(cfg) -> torch.dtype:
    """The dtype `load_target` loads the target in (load_model's choice for `auto`), known before it loads: vLLM,
    which starts first, runs the target in it too."""
    if str(cfg.target.dtype) != "auto":
        return DTYPES[str(cfg.target.dtype)]
    cuda = target_device(cfg).startswith("cuda") or (cfg.target.device_map and torch.cuda.is_available())
    return DTYPES[cuda_dtype() if cuda else resolve_dtype("auto", "teacher")]


def ranks_setting(cfg) -> str:
    placement = str(cfg.target.get("ranks", "auto"))
    if placement not in ("auto", "all", "first"):
        raise DraftsmithError(f"target.ranks must be all (a replica on every rank), first (rank 0 alone; the others "
                              f"train on kept logits) or auto (first where training never calls the target), got "
                              f"{placement!r}")
    return placement


def training_calls_target(cfg, feature: bool, online: bool, teacher_cache, kept: bool) -> str | None:
    """Why a training step would run the target (so every rank must hold it), or None: it reads kept logits only
    (`kept`: the corpus holds the target's logits, as it sampled them)."""
    if feature:
        return "a feature draft is built from the target's pass"
    if online:
        return "data.features=online runs the target in every step"
    if cfg.data.on_policy_fraction > 0:
        return "data.on_policy_fraction > 0: the target scores the draft's own samples"
    if not cfg.loss.get("distill", True):
        return None
    if teacher_cache is None:
        return "loss.teacher_topk=0: the target's whole logits in every step"
    if not kept:
        return "the corpus kept no logits of the target (sample it with data=generated, or bring prompt + completion)"
    return None


def first_rank_only(placement: str, why: str | None) -> bool:
    """True: the target on rank 0 alone (it validates and reports); False: a replica on every rank."""
    if placement == "first" and why:
        raise DraftsmithError(f"target.ranks=first, but training calls the target ({why}): use target.ranks=all")
    return placement == "first" or (placement == "auto" and why is None)
