"""Train a draft model for speculative sampling against a target, and keep the one the target accepts most.

    python train/draft.py recipe=shallow_wide                 # demo: SmolLM2-135M, stdlib corpus, ~40 min on 2 cores
    python train/draft.py recipe=smoke                        # tiny end-to-end check, < 2 min
    torchrun --nproc-per-node 8 -m draftsmith.train.draft recipe=gpu_8b target.name=DIR data.prompts=PROMPTS.jsonl
"""

from __future__ import annotations

from draftsmith.sampling.errors import DraftsmithError
from draftsmith.train import MissingExtra, require_train_extra

try:  # first: without the `train` extra, the entry says which install is missing in one line, not a traceback
    require_train_extra()
except MissingExtra as e:
    raise SystemExit(str(e)) from None

import logging
import os
import sys
import time
from pathlib import Path

import hydra
import lightning as L
from omegaconf import DictConfig, OmegaConf

from draftsmith.data.prompts import split_prompts
from draftsmith.drafts.build import TargetWeights
from draftsmith.engines import vllm
from draftsmith.sampling.load import load_tokenizer
from draftsmith.sampling.precision import run_info
from draftsmith.train import budget, schema
from draftsmith.train.data import check_data
from draftsmith.train.draft_init import draft_config, initial_draft
from draftsmith.train.fit import acceptance_callback, draft_module, lightning_trainer, teacher_store
from draftsmith.train.launch import Launch, agree, check_trainer, detect, devices_per_node, of_trainer, run_name
from draftsmith.train.plan import plan_run
from draftsmith.train.prepare import check_prepared, prepare_only, run_data, vllm_samples
from draftsmith.train.report import final_report, print_report
from draftsmith.train.rundir import check_writable, claim_run_dir, resume_checkpoint
from draftsmith.train.target import load_target, ranks_setting
from draftsmith.train.tracking import log_config, log_draft

schema.register()  # recipes/draft.yaml starts from it: registered before Hydra composes
log = logging.getLogger("draftsmith")


def train(cfg: DictConfig) -> dict:
    t0 = time.time()
    schema.check(cfg)  # a key a `+` override invented, before any work
    budget.check_recipe(cfg, budget.recipe_choice())  # a CPU recipe on GPUs, a GPU recipe with no target
    L.seed_everything(cfg.seed, verbose=False)
    if cfg.get("plan"):  # what a run would hold per rank, from the target's config alone; nothing is trained
        return plan_run(cfg)
    launch = of_trainer(cfg.trainer)  # who this process is, whatever started it: before any work
    print(launch.line(), flush=True)
    check_trainer(launch, devices_per_node(cfg.trainer), int(cfg.trainer.get("num_nodes", 1) or 1))
    out_dir = check_writable(cfg.out_dir)
    _one_run_dir(launch, out_dir, cfg)
    claim_run_dir(out_dir)  # a second run in the same directory is refused, not interleaved

    # 1. Plan: what a bad setting would break is refused here, before any work (a damaged checkpoint, a bad prompts
    # file, a bad draft setting); `draftsmith data` prepares the corpus and stops.
    resume = resume_checkpoint(out_dir, cfg.ckpt_path)
    tok = load_tokenizer(cfg.target.name)
    check_data(cfg, tok)
    file_prompts, val_prompts = split_prompts(cfg, tok)
    draft_cfg = draft_config(cfg)
    if cfg.get("prepare_only"):
        return prepare_only(cfg, tok, file_prompts, out_dir, launch)
    check_prepared(cfg, tok, file_prompts, out_dir, launch)  # a GPU recipe: no rank waits while rank 0 samples
    placement = ranks_setting(cfg)

    # The frozen target, in the precision its teacher passes run fastest in on this machine. Rank 0 holds it (it
    # prepares the corpus, validates and reports); another rank loads it only where training calls it. The draft is
    # built from the target's weights read by name, on every rank alike. vLLM samples the corpus before the target
    # loads (data.generated.engine=vllm): on a GPU it takes its share of memory first, the target loads beside it.
    weights = TargetWeights.of(cfg.target.name, bool(cfg.target.trust_remote_code))
    vllm_first = vllm_samples(cfg) and weights is not None
    if vllm_samples(cfg) and launch.first:  # the rank that samples: no vLLM, or a target it cannot run, refused
        vllm.ready(cfg.target.name)
    target = load_target(cfg) if (launch.first or weights is None) and not vllm_first else None
    target_config = (weights or target).config

    def teacher():  # the target, loaded on first use
        nonlocal target
        if target is None:
            target = load_target(cfg)
        return target

    # 2. Data: the corpus, tokenized with the target's tokenizer (optionally sampled from the target itself).
    data = run_data(cfg, tok, teacher, file_prompts, target_config, out_dir, launch)
    if launch.first:
        teacher()

    # 3. The draft: shallow and wide, of the target's family, sharing its vocabulary; or a feature draft.
    draft, head_tokens, target = initial_draft(cfg, draft_cfg, tok, data, weights, target, teacher,
                                               one_rank=launch.world_size == 1)
    feature = draft_cfg.kind == "feature_head"  # its pruned head's tokens are its own; it keeps the features too

    # 4. Fit: the teacher's store and where the target is held, the module, acceptance validation, best-by-acceptance
    # checkpoints, loggers; then train (ckpt_path=last resumes with optimizer, loops and best-checkpoint state).
    teacher_cache, first_only, why = teacher_store(cfg, data, draft, feature, head_tokens, target_config, out_dir,
                                                   placement, launch)
    if target is None and not first_only:
        target = load_target(cfg)
    if not launch.first:
        print(f"draftsmith: rank {launch.rank} "
              + ("holds no target: it trains on the target's kept logits, rank 0 validates" if target is None
                 else f"holds a replica of the target: {why or 'target.ranks=all'}"), flush=True)
    module = draft_module(cfg, draft, target, draft_cfg, data, teacher_cache, head_tokens, first_only)
    acceptance_cb = acceptance_callback(cfg, tok, data, val_prompts, out_dir)
    trainer, checkpoint_cb, last_cb = lightning_trainer(cfg, launch, draft, out_dir, data.train_dl, acceptance_cb)
    if trainer.is_global_zero:
        log_config(trainer.loggers, cfg, run=run_info(target=target), training_precision=str(trainer.precision),
                   draft_params=sum(p.numel() for p in draft.parameters()), corpus=data.record)
    trainer.fit(module, data.train_dl, data.val_dl, ckpt_path=resume, weights_only=True)

    # 5. Report: save the best draft as a HF checkpoint, measure it and the cut-target baseline.
    if not trainer.is_global_zero:
        return {}
    tps = trainer.callback_metrics.get("train/tokens_per_s")
    report = final_report(target=target, module=module, tokenizer=tok, cfg=cfg, out_dir=out_dir,
                          checkpoint_cb=checkpoint_cb, last_path=last_cb.best_model_path, acceptance_cb=acceptance_cb,
                          wall_s=time.time() - t0,
                          tokens_per_s=float(tps) if tps is not None else None, precision=trainer.precision,
                          token_counts=data.token_counts)
    log_draft(trainer.loggers, Path(report["best_draft"]),
              {k: report[k] for k in ("monitor", "best_score", "c", "draft_layers", "draft_params", "sampler")})
    print_report(report)
    return report


def _run_name(_root_) -> str:
    """The default run dir's name (recipes/draft.yaml): date/time-pid of the job's rank 0, shared with every process
    the launcher started (train/launch.py); the pid keeps two runs started in the same second apart."""
    try:
        return run_name(lambda: of_trainer(_root_.trainer), 60 * float(_root_.launch.join_minutes))
    except DraftsmithError as e:  # raised while Hydra resolves the run dir: not a traceback, one line
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


OmegaConf.register_new_resolver("pid", os.getpid, replace=True)
OmegaConf.register_new_resolver("run_name", _run_name, replace=True)
# Hydra's own files of the run (.hydra/) written once, by the job's rank 0 (Lightning's launcher does the same for the
# ranks it spawns): two processes writing one config file at once could leave it torn
OmegaConf.register_new_resolver("hydra_subdir", lambda: ".hydra" if detect().first else None, replace=True)


# an absolute path: `recipes/` sits beside this package in the checkout and in the installed wheel alike, and the
# path works for `python train/draft.py`, `python -m draftsmith.train.draft` and `draftsmith train`
RECIPES = str(Path(__file__).resolve().parent.parent / "recipes")


def _one_run_dir(launch: Launch, out_dir: Path, cfg) -> None:
    """Every process of the job in rank 0's run dir, checked when all have met: a `hydra.run.dir` that names another
    dir on some process (a per-process interpolation, another working directory) would split the run."""
    agree(launch, "run dir", str(out_dir.resolve()), 60 * float(cfg.launch.join_minutes),
          same="give every process the same hydra.run.dir (or none: rank 0 names it for all), on storage every node "
               "shares")


@hydra.main(version_base="1.3", config_path=RECIPES, config_name="draft")
def app(cfg: DictConfig) -> float | None:
    """The objective a Hydra sweeper maximises: the best `checkpoint.monitor` (val/alpha_on_target by default)."""
    logging.getLogger("lightning.pytorch").propagate = False  # Hydra's job logging would print each line twice
    try:
        return train(cfg).get("best_score")
    except ValueError as e:  # a DraftsmithError (DiskFull too), or bad input
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def main() -> None:
    """`python train/draft.py OVERRIDES` (and `draftsmith train`): the overrides checked in one line, then the run."""
    try:
        schema.preflight(sys.argv[1:], RECIPES)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    app()


if __name__ == "__main__":
    main()
