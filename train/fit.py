"""What `trainer.fit` is given: the teacher's store (the target's kept logits, or none), where the target is held,
the Lightning module, and the trainer with its callbacks (acceptance validation, best-by-acceptance checkpoints,
the last checkpoint for resume, progress) and loggers."""

from __future__ import annotations

from pathlib import Path

import lightning as L
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import OmegaConf

from draftsmith.data.corpus import prefill_labels, prefill_teacher, sampled_rows
from draftsmith.data.prompts import on_target_prompts, validation_prompts
from draftsmith.data.teacher import TeacherCache
from draftsmith.sampling.precision import trainer_precision
from draftsmith.train.callbacks import AcceptanceCallback
from draftsmith.train.data import DataOrder
from draftsmith.train.launch import Launch, cluster_environment
from draftsmith.train.module import DraftModule
from draftsmith.train.progress import RunProgress
from draftsmith.train.rundir import AtomicCheckpointIO
from draftsmith.train.strategy import build_strategy
from draftsmith.train.target import first_rank_only, training_calls_target
from draftsmith.train.tracking import loggers


def teacher_store(cfg, data, draft, feature: bool, head_tokens, target_config, out_dir: Path, placement: str,
                  launch: Launch) -> tuple[TeacherCache | None, bool, str | None]:
    """(the teacher's store, whether the target sits on rank 0 alone, why training calls it). The store holds the
    target's top-k logits per position (loss.teacher_topk), filled from what the corpus kept as the target sampled
    it; a rank without the target trains on those alone, so a block that lacks them puts a replica on every rank."""
    topk = cfg.loss.get("teacher_topk", 0)
    online = feature and cfg.data.get("features", "stored") == "online"  # the target's pass in every step instead
    blocks, chat, source = data.blocks, data.chat, data.record["source"]
    if chat and topk and feature:
        print("draftsmith: data=chat with draft.kind=feature_head: the target runs in every training step (the head "
              "reads its features at every context token, which the chat store does not keep); loss.teacher_topk is "
              "not used", flush=True)
    # data=chat: a block is a sample, as wide as the widest batch (whose width is rounded up, past the longest sample)
    rows, width = ((len(blocks["samples"]), max([b["ids"].shape[1] for b in blocks["train"]]
                                                + [len(x.ids) for x in blocks["samples"]])) if chat
                   else (len(blocks["train"]), cfg.data.block_size))
    cache = TeacherCache(rows, width - 1, topk, target_config.vocab_size,
                         draft.token_ids() if feature and draft.pruned else head_tokens,
                         features=3 * target_config.hidden_size if feature else 0,
                         directory=out_dir) if topk and not online and not (chat and feature) else None
    # where the target is held: with several ranks, on rank 0 alone when training never calls it (target.ranks)
    why = training_calls_target(cfg, feature, online, cache, "train_src" in blocks or "kept" in data.record)
    first_only = first_rank_only(placement, why) and launch.world_size > 1
    if cache is not None and "train_src" in blocks:
        # a rank without the target cannot fill a block's gaps: each block trains on the positions its corpus kept
        filled = prefill_teacher(cache, blocks["train_src"], Path(source), sampled_rows(source),
                                 draft.feature_layers if feature else None, min_known=0.0 if first_only else 0.5,
                                 positions=blocks.get("train_pos"))
        what = "logits and features" if feature else "logits"
        print(f"draftsmith: {filled} of {len(blocks['train'])} training blocks take the target's {what} kept as it "
              "sampled them: no teacher pass over those", flush=True)
        if first_only and filled < len(blocks["train"]):  # the corpus kept fewer than loss.teacher_topk per token
            why = (f"{len(blocks['train']) - filled} of {len(blocks['train'])} training blocks lack kept logits "
                   f"(loss.teacher_topk={topk} needs as many kept per token)")
            first_only = first_rank_only(placement, why)
    elif cache is not None and chat and "kept" in data.record:  # the teacher pass chatcorpus.prepare kept
        samples = [x.ids for x in blocks["samples"]]
        kept = data.record["kept"]
        filled = prefill_labels(cache, Path(kept), sampled_rows(kept) or [], samples)
        print(f"draftsmith: {filled} of {len(samples)} training samples take the target's top-{topk} logits kept "
              f"in {kept}: no teacher pass over those", flush=True)
        if filled < len(samples):  # a store cut short or of other samples: those go to the teacher pass
            why = f"{len(samples) - filled} of {len(samples)} training samples lack kept logits"
            first_only = first_rank_only(placement, why) and launch.world_size > 1
    return cache, first_only, why


def draft_module(cfg, draft, target, draft_cfg, data, teacher_cache, head_tokens, first_only: bool) -> DraftModule:
    return DraftModule(draft, target, loss=OmegaConf.to_container(cfg.loss), optim=OmegaConf.to_container(cfg.optim),
                       sampler=OmegaConf.to_container(cfg.sampler), max_steps=cfg.trainer.max_steps,
                       on_policy=data.on_policy, unroll=draft_cfg.unroll, step_decay=draft_cfg.step_decay,
                       feature_noise=draft_cfg.feature_noise,
                       teacher_cache=teacher_cache, head_tokens=head_tokens, validate_on_first=first_only,
                       row_positions=data.blocks.get("train_pos"), packed=cfg.data.get("rows") == "packed")


def acceptance_callback(cfg, tok, data, val_prompts, out_dir: Path) -> AcceptanceCallback:
    """Validation by acceptance against the target with the bundled sampler, on prompts no step trains on."""
    s, blocks = cfg.sampler, data.blocks
    if data.chat:  # the held-out conversations' first user turns, through the template: the same prompts for both
        ids, mask = (t[: s.n_prompts] for t in blocks["prompts"])
        on_target = tuple(t[: s.on_target_prompts] for t in blocks["prompts"]) if s.on_target_tokens else None
    else:
        ids, mask = validation_prompts(blocks, s.n_prompts, s.prompt_tokens)
        on_target = on_target_prompts(cfg, tok, blocks, val_prompts)
    return AcceptanceCallback(ids, mask, tok, k=s.k, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                              max_new_tokens=s.max_new_tokens, seed=cfg.seed, on_target_prompts=on_target,
                              on_target_tokens=s.on_target_tokens, compile=s.get("compile", False),
                              samples_path=out_dir / "val_target_samples.safetensors")


def lightning_trainer(cfg, launch: Launch, draft, out_dir: Path, train_dl, acceptance_cb):
    """(trainer, best checkpoint callback, last checkpoint callback)."""
    metric = cfg.checkpoint.monitor
    checkpoint_cb = ModelCheckpoint(dirpath=out_dir / "checkpoints", monitor=metric, mode=cfg.checkpoint.mode,
                                    save_top_k=1, auto_insert_metric_name=False,
                                    filename=f"step{{step}}-{metric.split('/')[-1]}{{{metric}:.4f}}")
    # last.ckpt at every validation, for resume: Lightning 2.6's save_last writes it only at a step that also saved
    # a best checkpoint, so a run whose score stopped improving would resume from its best step, not its last
    last_cb = ModelCheckpoint(dirpath=out_dir / "checkpoints", filename="last", monitor=None, save_top_k=1,
                              enable_version_counter=False)
    kwargs = OmegaConf.to_container(cfg.trainer)
    kwargs["precision"] = trainer_precision(str(kwargs["precision"]), kwargs["accelerator"])
    kwargs["plugins"] = [cluster_environment(launch)]  # Lightning counts the ranks as we do
    if isinstance(kwargs.get("strategy"), dict):  # FSDP wraps by the draft's layer class (train/strategy.py)
        kwargs["strategy"] = build_strategy(cfg.trainer.strategy, draft)
    elif "deepspeed" not in str(kwargs.get("strategy", "")):  # DeepSpeed writes directories of its own
        kwargs["plugins"].append(AtomicCheckpointIO())
    extra = [instantiate(spec) for spec in (cfg.get("callbacks") or {}).values() if spec]  # the `callbacks` group
    progress = [RunProgress(metric)] if kwargs.get("enable_progress_bar", True) else []
    trainer = L.Trainer(**kwargs, default_root_dir=str(out_dir),
                        callbacks=[acceptance_cb, DataOrder(train_dl), checkpoint_cb, last_cb, *extra, *progress],
                        logger=loggers(cfg))
    return trainer, checkpoint_cb, last_cb
