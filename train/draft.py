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

import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path

import hydra
import lightning as L
import torch
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig, OmegaConf

from draftsmith.data import chatcorpus
from draftsmith.data.chat import padding_share
from draftsmith.data.corpus import (
    generate_corpus,
    load_blocks,
    pair_rows,
    prefill_labels,
    prefill_teacher,
    sampled_rows,
)
from draftsmith.data.generation import EngineCheck, choose_engine, measure_engines
from draftsmith.data.prompts import on_target_prompts, prompt_tensor, prompt_texts, split_prompts, validation_prompts
from draftsmith.data.rows import line_count, rows_digest
from draftsmith.data.teacher import TeacherCache
from draftsmith.drafts.build import DraftConfig, TargetWeights, build_draft
from draftsmith.drafts.feature import build_feature_draft
from draftsmith.engines import vllm
from draftsmith.sampling.feature import FeatureConfig
from draftsmith.sampling.load import load_model, load_tokenizer
from draftsmith.sampling.machine import cache_home
from draftsmith.sampling.precision import DTYPES, cuda_dtype, run_info, trainer_precision
from draftsmith.sampling.precision import resolve as resolve_dtype
from draftsmith.sampling.probs import SamplingConfig
from draftsmith.sampling.prompts import pad_id, prompt_rows
from draftsmith.sampling.pruned import top_tokens
from draftsmith.train import budget, schema
from draftsmith.train.callbacks import AcceptanceCallback
from draftsmith.train.data import (
    DataOrder,
    blocks_digest,
    chat_loaders,
    check_data,
    loaders,
    prepared_once,
)
from draftsmith.train.launch import (
    Launch,
    agree,
    check_trainer,
    cluster_environment,
    detect,
    devices_per_node,
    of_trainer,
    run_name,
)
from draftsmith.train.module import DraftModule
from draftsmith.train.onpolicy import OnPolicy
from draftsmith.train.progress import RunProgress
from draftsmith.train.report import final_report, print_report
from draftsmith.train.rundir import AtomicCheckpointIO, check_writable, claim_run_dir, resume_checkpoint
from draftsmith.train.strategy import build_strategy
from draftsmith.train.tracking import log_config, log_draft, loggers

schema.register()  # recipes/draft.yaml starts from it: registered before Hydra composes
log = logging.getLogger("draftsmith")


def train(cfg: DictConfig) -> dict:
    t0 = time.time()
    schema.check(cfg)  # a key a `+` override invented, before any work
    budget.check_recipe(cfg, budget.recipe_choice())  # a CPU recipe on GPUs, a GPU recipe with no target
    L.seed_everything(cfg.seed, verbose=False)
    if cfg.get("plan"):  # what a run would hold per rank, from the target's config alone; nothing is trained
        return _plan(cfg)
    launch = of_trainer(cfg.trainer)  # who this process is, whatever started it: before any work
    print(launch.line(), flush=True)
    check_trainer(launch, devices_per_node(cfg.trainer), int(cfg.trainer.get("num_nodes", 1) or 1))
    out_dir = check_writable(cfg.out_dir)
    _one_run_dir(launch, out_dir, cfg)
    claim_run_dir(out_dir)  # a second run in the same directory is refused, not interleaved

    # 1. The frozen target and its tokenizer, in the precision its teacher passes run fastest in on this machine.
    # Rank 0 holds it (it prepares the corpus, validates and reports); another rank loads it in step 4 only where
    # training calls it. The draft is built from the target's weights read by name, on every rank alike.
    resume = resume_checkpoint(out_dir, cfg.ckpt_path)  # a damaged checkpoint fails here, before any work
    tok = load_tokenizer(cfg.target.name)
    check_data(cfg, tok)
    file_prompts, val_prompts = split_prompts(cfg, tok)  # a bad prompts file fails here, before any work
    draft_cfg = _draft_config(cfg)  # a bad draft setting too, not after sampling
    if cfg.get("prepare_only"):  # `draftsmith data`: the corpus, then stop
        return _prepare_only(cfg, tok, file_prompts, out_dir, launch)
    _corpus_prepared(cfg, tok, file_prompts, out_dir, launch)  # a GPU recipe: no rank waits while rank 0 samples
    placement = _target_ranks_setting(cfg)
    weights = TargetWeights.of(cfg.target.name, bool(cfg.target.trust_remote_code))
    # vLLM samples the corpus before the target loads (data.generated.engine=vllm): on a GPU it takes its share of
    # memory first (data.generated.gpu_memory_utilization), and the target loads beside it when its check needs it
    vllm_first = _vllm_samples(cfg) and weights is not None
    if _vllm_samples(cfg) and launch.first:  # the rank that samples: no vLLM, or a target it cannot run, refused
        vllm.ready(cfg.target.name)  # before any work
    target = _load_target(cfg) if (launch.first or weights is None) and not vllm_first else None
    target_config = (weights or target).config

    def teacher():  # the target, loaded on first use
        nonlocal target
        if target is None:
            target = _load_target(cfg)
        return target

    # 2. The corpus, tokenized with the target's tokenizer (optionally sampled from the target itself).
    chat = cfg.data.get("format") == "chat"  # conversations, one a sample (data/chatcorpus.py)
    data = prepared_once(out_dir, lambda: chatcorpus.prepare(cfg, tok, teacher, _corpus_dir(cfg, out_dir, launch),
                                                             engine=_chat_engine(cfg, teacher, tok))
                         if chat else _prepare_corpus(cfg, teacher, tok, file_prompts, target_config,
                                                      _corpus_dir(cfg, out_dir, launch)),
                         _corpus_wait_s(cfg), launch)
    if launch.first:
        teacher()
    source = data["source"]
    if chat:
        blocks = chatcorpus.chat_blocks(cfg, tok, data)
        print(f"draftsmith: rank {launch.rank} trains on {len(blocks['train'])} batches of whole conversations of "
              f"{source} ({padding_share(blocks['train']):.0%} padding)", flush=True)
        train_dl, val_dl = chat_loaders(blocks, cfg)
        on_policy = None
        token_counts = chatcorpus.token_counts(blocks, target_config.vocab_size)
    else:
        blocks = load_blocks(source, tok, cfg.data.block_size, cfg.data.val_fraction, cfg.seed, cfg.data.text_field,
                             data["documents"])
        print(f"draftsmith: rank {launch.rank} trains on "
              f"{len(blocks['train'])} blocks of {source}, sha256 {blocks_digest(blocks)}", flush=True)
        train_dl, val_dl = loaders(blocks, cfg)
        on_policy = _on_policy(cfg, tok, blocks, file_prompts)
        token_counts = torch.bincount(blocks["train"].flatten(), minlength=target_config.vocab_size)
    # a chat item is a whole batch already (train/data.py chat_loaders): counted in micro-batches' rows like a block
    items = len(blocks["train"]) * (int(cfg.data.batch_size) if chat else 1)
    steps = budget.derived_steps(cfg, items, launch.world_size)
    if steps is not None:  # a budget in epochs: the LR schedule and the progress need its steps
        print(f"draftsmith: budget {budget.budget_line(cfg)}: {data.get('rows') or 'the corpus'} samples in "
              f"{len(blocks['train'])} {'batches of whole conversations' if chat else 'blocks'} of "
              f"{cfg.data.block_size} tokens, {launch.world_size} rank(s) x micro-batch {cfg.data.batch_size}: "
              f"{steps} steps", flush=True)
        cfg.trainer.max_steps = steps

    # 3. The draft: shallow and wide, of the target's family, sharing its vocabulary; or a feature draft.
    if draft_cfg.kind == "feature_head":  # built from a pass of the target: every rank holds it
        target = target or _load_target(cfg)
        draft = build_feature_draft(target, draft_cfg.feature_layers, draft_cfg.draft_vocab,
                                    _head_frequencies(cfg, draft_cfg, tok, token_counts), draft_cfg.freeze_head,
                                    probe=blocks["train"][0]["ids"][:4] if chat else blocks["train"][:4])
    else:
        draft = build_draft(weights or target, draft_cfg)
    head_tokens = None
    if draft_cfg.draft_vocab and draft_cfg.kind != "feature_head":  # the sampler's choice of rows (+ EOS)
        if draft_cfg.draft_vocab >= target_config.vocab_size:
            raise DraftsmithError(f"draft.draft_vocab={draft_cfg.draft_vocab} prunes nothing: the target has "
                                  f"{target_config.vocab_size} tokens; set it lower or to null (the full head)")
        head_tokens = top_tokens(_head_frequencies(cfg, draft_cfg, tok, token_counts), draft_cfg.draft_vocab,
                                 [tok.eos_token_id])
    if draft.config.vocab_size != target_config.vocab_size:
        raise DraftsmithError(f"draft vocabulary ({draft.config.vocab_size}) differs from the target's "
                              f"({target_config.vocab_size}); drafts must share the target's tokenizer")

    # 4. Lightning: module, acceptance validation, best-by-acceptance checkpoints, loggers.
    topk = cfg.loss.get("teacher_topk", 0)
    feature = draft_cfg.kind == "feature_head"  # its pruned head's tokens are its own; it keeps the features too
    online = feature and cfg.data.get("features", "stored") == "online"  # the target's pass in every step instead
    if chat and topk and feature:
        print("draftsmith: data=chat with draft.kind=feature_head: the target runs in every training step (the head "
              "reads its features at every context token, which the chat store does not keep); loss.teacher_topk is "
              "not used", flush=True)
    # data=chat: a block is a sample, as wide as the widest batch (whose width is rounded up, past the longest sample)
    rows, width = ((len(blocks["samples"]), max([b["ids"].shape[1] for b in blocks["train"]]
                                                + [len(x.ids) for x in blocks["samples"]])) if chat
                   else (len(blocks["train"]), cfg.data.block_size))
    teacher_cache = TeacherCache(rows, width - 1, topk, target_config.vocab_size,
                                 draft.token_ids() if feature and draft.pruned else head_tokens,
                                 features=3 * target_config.hidden_size if feature else 0,
                                 directory=out_dir) if topk and not online and not (chat and feature) else None
    # where the target is held: with several ranks, on rank 0 alone when training never calls it (target.ranks)
    why = _training_calls_target(cfg, feature, online, teacher_cache, "train_src" in blocks or "kept" in data)
    first_only = _target_ranks(placement, why) and launch.world_size > 1
    if teacher_cache is not None and "train_src" in blocks:
        # a rank without the target cannot fill a block's gaps: each block trains on the positions its corpus kept
        filled = prefill_teacher(teacher_cache, blocks["train_src"], Path(source), sampled_rows(source),
                                 draft.feature_layers if feature else None, min_known=0.0 if first_only else 0.5)
        what = "logits and features" if feature else "logits"
        print(f"draftsmith: {filled} of {len(blocks['train'])} training blocks take the target's {what} kept as it "
              "sampled them: no teacher pass over those", flush=True)
        if first_only and filled < len(blocks["train"]):  # the corpus kept fewer than loss.teacher_topk per token
            why = (f"{len(blocks['train']) - filled} of {len(blocks['train'])} training blocks lack kept logits "
                   f"(loss.teacher_topk={topk} needs as many kept per token)")
            first_only = _target_ranks(placement, why)
    elif teacher_cache is not None and chat and "kept" in data:  # the teacher pass chatcorpus.prepare kept
        samples = [x.ids for x in blocks["samples"]]
        filled = prefill_labels(teacher_cache, Path(data["kept"]), sampled_rows(data["kept"]) or [], samples)
        print(f"draftsmith: {filled} of {len(samples)} training samples take the target's top-{topk} logits kept "
              f"in {data['kept']}: no teacher pass over those", flush=True)
        if filled < len(samples):  # a store cut short or of other samples: those go to the teacher pass
            why = f"{len(samples) - filled} of {len(samples)} training samples lack kept logits"
            first_only = _target_ranks(placement, why) and launch.world_size > 1
    if target is None and not first_only:
        target = _load_target(cfg)
    if not launch.first:
        print(f"draftsmith: rank {launch.rank} "
              + ("holds no target: it trains on the target's kept logits, rank 0 validates" if target is None
                 else f"holds a replica of the target: {why or 'target.ranks=all'}"), flush=True)
    module = DraftModule(draft, target, loss=OmegaConf.to_container(cfg.loss), optim=OmegaConf.to_container(cfg.optim),
                         sampler=OmegaConf.to_container(cfg.sampler), max_steps=cfg.trainer.max_steps,
                         on_policy=on_policy, unroll=draft_cfg.unroll, step_decay=draft_cfg.step_decay,
                         feature_noise=draft_cfg.feature_noise,
                         teacher_cache=teacher_cache, head_tokens=head_tokens, validate_on_first=first_only)
    s = cfg.sampler
    if chat:  # the held-out conversations' first user turns, through the template: the same prompts for both
        ids, mask = (t[: s.n_prompts] for t in blocks["prompts"])
        on_target = tuple(t[: s.on_target_prompts] for t in blocks["prompts"]) if s.on_target_tokens else None
    else:
        ids, mask = validation_prompts(blocks, s.n_prompts, s.prompt_tokens)
        on_target = on_target_prompts(cfg, tok, blocks, val_prompts)
    acceptance_cb = AcceptanceCallback(ids, mask, tok, k=s.k, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                       max_new_tokens=s.max_new_tokens, seed=cfg.seed,
                                       on_target_prompts=on_target,
                                       on_target_tokens=s.on_target_tokens, compile=s.get("compile", False),
                                       samples_path=out_dir / "val_target_samples.safetensors")
    metric = cfg.checkpoint.monitor
    checkpoint_cb = ModelCheckpoint(dirpath=out_dir / "checkpoints", monitor=metric, mode=cfg.checkpoint.mode,
                                    save_top_k=1, auto_insert_metric_name=False,
                                    filename=f"step{{step}}-{metric.split('/')[-1]}{{{metric}:.4f}}")
    # last.ckpt at every validation, for resume: Lightning 2.6's save_last writes it only at a step that also saved
    # a best checkpoint, so a run whose score stopped improving would resume from its best step, not its last
    last_cb = ModelCheckpoint(dirpath=out_dir / "checkpoints", filename="last", monitor=None, save_top_k=1,
                              enable_version_counter=False)
    trainer_kwargs = OmegaConf.to_container(cfg.trainer)
    trainer_kwargs["precision"] = trainer_precision(str(trainer_kwargs["precision"]), trainer_kwargs["accelerator"])
    trainer_kwargs["plugins"] = [cluster_environment(launch)]  # Lightning counts the ranks as we do
    if isinstance(trainer_kwargs.get("strategy"), dict):  # FSDP wraps by the draft's layer class (train/strategy.py)
        trainer_kwargs["strategy"] = build_strategy(cfg.trainer.strategy, draft)
    elif "deepspeed" not in str(trainer_kwargs.get("strategy", "")):  # DeepSpeed writes directories of its own
        trainer_kwargs["plugins"].append(AtomicCheckpointIO())
    trainer = L.Trainer(**trainer_kwargs, default_root_dir=str(out_dir),
                        callbacks=[acceptance_cb, DataOrder(train_dl), checkpoint_cb, last_cb, *_callbacks(cfg),
                                   *([RunProgress(metric)] if trainer_kwargs.get("enable_progress_bar", True) else [])],
                        logger=loggers(cfg))
    if trainer.is_global_zero:
        log_config(trainer.loggers, cfg, run=run_info(target=target), training_precision=str(trainer.precision),
                   draft_params=sum(p.numel() for p in draft.parameters()), corpus=data)

    # 5. Train (ckpt_path=last resumes with optimizer, loops and best-checkpoint state).
    trainer.fit(module, train_dl, val_dl, ckpt_path=resume, weights_only=True)

    # 6. Report: save the best draft as a HF checkpoint, measure it and the cut-target baseline.
    if not trainer.is_global_zero:
        return {}
    tps = trainer.callback_metrics.get("train/tokens_per_s")
    report = final_report(target=target, module=module, tokenizer=tok, cfg=cfg, out_dir=out_dir,
                          checkpoint_cb=checkpoint_cb, last_path=last_cb.best_model_path, acceptance_cb=acceptance_cb,
                          wall_s=time.time() - t0,
                          tokens_per_s=float(tps) if tps is not None else None, precision=trainer.precision,
                          token_counts=token_counts)
    log_draft(trainer.loggers, Path(report["best_draft"]),
              {k: report[k] for k in ("monitor", "best_score", "c", "draft_layers", "draft_params", "sampler")})
    print_report(report)
    return report


def _generated_corpus(cfg, teacher, tok, file_prompts, target_config, home: Path):
    """`data=generated`: the target samples continuations of the prompts once; cached and resumable. `teacher()`
    returns the target, loading it on first use: vLLM needs it only for its check, after its own start."""
    g = cfg.data.generated
    prompts, name = _generated_key(cfg, tok, file_prompts)
    keep = cfg.loss.get("teacher_topk", 0) if cfg.loss.get("distill", True) else 0
    kw = _corpus_engine(cfg, teacher, tok, lambda: prompt_rows(tok, prompts[: g.batch_size]))
    engine = kw.pop("engine")
    if engine == "vllm":  # its own seeds: its samples extend its own file, never ours
        name += "-vllm"
    path = home / "generated" / f"{name}.jsonl"
    s = cfg.sampler
    return generate_corpus(None if engine == "vllm" else teacher(), tok, prompts, path,
                           samples_per_prompt=g.samples_per_prompt, max_new_tokens=g.max_new_tokens,
                           temperature=s.temperature, top_p=s.top_p, batch_size=g.batch_size, seed=cfg.seed,
                           max_seconds=None if g.max_minutes is None else 60 * g.max_minutes,
                           keep_logits=keep, keep_features=_feature_layers(cfg, target_config) if keep else None,
                           engine=engine, data_parallel_size=g.get("data_parallel_size", 1), **kw)


def _corpus_engine(cfg, teacher, tok, rows) -> dict:
    """The engine that samples the target's corpus or regenerates its conversations (data.generated.engine; `auto`
    measured once on `rows()`, a batch of prompt ids) and its settings, as `generate_corpus` and `regenerate` take
    them. vLLM is judged before any of its samples is kept, against the target itself in the dtype vLLM runs (like
    with like), on its device: never an fp32 copy; `teacher()` loads it only then, after vLLM's start."""
    g, s = cfg.data.generated, cfg.sampler
    vllm_kw = dict(tensor_parallel_size=g.get("tensor_parallel_size", 1),
                   gpu_memory_utilization=g.get("gpu_memory_utilization", 0.5))
    engine = g.get("engine", "draftsmith")
    if engine != "vllm":  # our loop samples with the target; auto measures both engines on it
        engine = choose_engine(engine, teacher(), cfg.target.name, lambda: measure_engines(
            teacher(), cfg.target.name, rows(), g.batch_size, temperature=s.temperature, top_p=s.top_p,
            eos=tok.eos_token_id, pad=pad_id(tok), **vllm_kw))
    if engine != "vllm":
        return {"engine": engine}
    dtype = _target_dtype(cfg)
    check = EngineCheck("vllm", teacher, tok, SamplingConfig(s.temperature, 0, s.top_p), cfg.target.name, dtype,
                        seed=cfg.seed)
    return {"engine": "vllm", "check": check, "dtype": dtype, "target_name": cfg.target.name, **vllm_kw}


def _generated_key(cfg, tok, file_prompts) -> tuple[list[str], str]:
    """The prompts a generated corpus continues, and its file's name (vLLM's samples add `-vllm`): it holds every
    setting but the prompt count, which may grow (resumable), and the prompts file's text itself: an edited file must
    not continue the samples of the old one."""
    g, s = cfg.data.generated, cfg.sampler
    if file_prompts is None:
        base = load_blocks(cfg.data.source, tok, cfg.data.block_size, cfg.data.val_fraction, cfg.seed,
                           cfg.data.text_field, cfg.data.max_documents)["train"]
        idx = torch.linspace(0, len(base) - 1, min(g.n_prompts, len(base))).long()
        prompts = prompt_texts(cfg, tok, base[idx, : cfg.data.prompt_tokens])
    else:
        prompts = file_prompts[: g.n_prompts]
    origin = hashlib.sha256(json.dumps([str(cfg.data.prompts), cfg.data.source, cfg.data.chat_template,
                                        file_prompts]).encode())
    return prompts, (f"{cfg.target.name.replace('/', '_')}-T{s.temperature}-p{s.top_p}-n{g.max_new_tokens}"
                     f"-seed{cfg.seed}-{origin.hexdigest()[:8]}")


def _corpus_prepared(cfg, tok, file_prompts, out_dir: Path, launch: Launch) -> None:
    """A GPU recipe trains on a corpus prepared before (`draftsmith data`, on every GPU of the node), so that no
    rank waits while rank 0 samples: refused in one line naming that command while its file is short of the
    samples the recipe asks for. A resumed run reads the corpus its data.json names; a CPU recipe samples in the
    run (the one-command demo)."""
    g = cfg.data.generated
    if cfg.sized_for.hardware != "gpu" or not g.enabled or (out_dir / "data.json").is_file():
        return
    recipe = budget.recipe_choice() or "NAME"
    if launch.nodes > 1 and not cfg.data.get("cache_dir"):
        raise DraftsmithError(f"{launch.nodes} nodes train on a corpus prepared before: prepare it on storage every "
                              f"node reads with `draftsmith data recipe={recipe} data.cache_dir=SHARED_DIR ...` and "
                              "train with the same data.cache_dir")
    prompts, name = _generated_key(cfg, tok, file_prompts)
    want = len(prompts) * int(g.samples_per_prompt)
    home = _corpus_dir(cfg, out_dir, launch)
    engines = ["-vllm"] if g.get("engine") == "vllm" else [""] if g.get("engine") == "draftsmith" else ["", "-vllm"]
    paths = [home / "generated" / f"{name}{e}.jsonl" for e in engines]
    have = max(line_count(p) if p.is_file() else 0 for p in paths)
    if have < want:
        args = " ".join(a for a in _task_overrides() if not a.startswith(("recipe=", "hydra.")))
        raise DraftsmithError(f"recipe={recipe} trains on a prepared corpus, and {paths[-1]} holds {have} of its "
                              f"{want} samples: prepare it first with `draftsmith data recipe={recipe}"
                              f"{' ' + args if args else ''}` (resumable), then train")


def _task_overrides() -> list[str]:
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def _prepare_only(cfg, tok, file_prompts, out_dir: Path, launch: Launch) -> dict:
    """`draftsmith data`: prepare the corpus where `train` will look for it (resumable: a rerun continues), then stop.
    Conversations (data=chat) also print `data.show` rendered samples with their trained tokens marked; continuations
    the target samples (data=generated, a GPU recipe's corpus) go to the file `_corpus_prepared` checks."""
    target = []

    def teacher():  # the target, loaded on first use (vLLM samples without it)
        if not target:
            target.append(_load_target(cfg))
        return target[0]

    if cfg.data.get("format") != "chat":
        if not cfg.data.generated.enabled:
            raise DraftsmithError("draftsmith data prepares what the target writes: add data=chat (conversations, "
                                  "data.source=FILE or sharegpt) or data=generated (continuations of prompts)")
        if _vllm_samples(cfg):
            vllm.ready(cfg.target.name)  # no vLLM, or a target it cannot run: refused before any work
        weights = TargetWeights.of(cfg.target.name, bool(cfg.target.trust_remote_code))
        record = _prepare_corpus(cfg, teacher, tok, file_prompts, (weights or teacher()).config,
                                 _corpus_dir(cfg, out_dir, launch))
        print(f"draftsmith: the corpus is ready: {record['rows']} samples in {record['source']}; draftsmith train "
              "with the same overrides uses it", flush=True)
        return record
    if _vllm_samples(cfg):
        vllm.ready(cfg.target.name)  # no vLLM, or a target it cannot run: refused before any work
    record = chatcorpus.prepare(cfg, tok, teacher, _corpus_dir(cfg, out_dir, launch),
                                engine=_chat_engine(cfg, teacher, tok))
    blocks = chatcorpus.chat_blocks(cfg, tok, record)
    n = sum(len(b["ids"]) for b in blocks["train"])
    print(f"draftsmith: the corpus is ready: {n} conversations of {record['source']} in {len(blocks['train'])} "
          f"batches ({padding_share(blocks['train']):.0%} padding); draftsmith train with the same overrides uses it")
    chatcorpus.print_samples(tok, blocks, cfg.data.get("show", 0))
    return record


def _callbacks(cfg) -> list:
    """The `callbacks` group's extra Lightning callbacks, each built by its `_target_`."""
    return [instantiate(spec) for spec in (cfg.get("callbacks") or {}).values() if spec]


def _imported_corpus(cfg, target, tok, pairs, home: Path) -> Path:
    """`data.source=` prompt + completion pairs sampled elsewhere: one teacher pass writes them to the same store as
    our own samples (the kept logits, a feature draft's features), once; cached by the file and the settings."""
    src = Path(cfg.data.source).expanduser().resolve()
    st = src.stat()
    keep = cfg.loss.get("teacher_topk", 0) if cfg.loss.get("distill", True) else 0
    layers = _feature_layers(cfg, target.config) if keep else None
    key = hashlib.sha256(json.dumps([str(src), st.st_size, int(st.st_mtime), cfg.data.get("prompt_field"),
                                     cfg.data.get("completion_field"), keep, layers]).encode()).hexdigest()[:12]
    path = home / "imported" / f"{cfg.target.name.replace('/', '_')}-{src.stem}-{key}.jsonl"
    prompts, completions = pairs
    return generate_corpus(target, tok, prompts, path, batch_size=8, seed=cfg.seed, keep_logits=keep,
                           keep_features=layers, completions=completions)


def _draft_config(cfg) -> DraftConfig:
    """`draft.*` as a DraftConfig, its values checked (its keys and types are the schema's: train/schema.py)."""
    return DraftConfig(**OmegaConf.to_container(cfg.draft))


def _plan(cfg) -> dict:
    from draftsmith.drafts.build import draft_config_for
    from draftsmith.sampling.load import config_of
    from draftsmith.train.losses import DIVERGENCES
    from draftsmith.train.plan import (
        DEFAULT_DEVICE_GIB,
        GIB,
        STRATEGIES,
        costs,
        feature_head_config,
        fits_smaller,
        plan,
        print_costs,
        print_plan,
    )

    draft_cfg = _draft_config(cfg)
    feature = draft_cfg.kind == "feature_head"
    target_config = config_of(cfg.target.name)  # config.json alone: no weights are fetched or read
    devices = cfg.trainer.get("devices", 1)
    devices = devices if isinstance(devices, int) else 1
    ranks = devices * int(cfg.trainer.get("num_nodes", 1) or 1)
    # the target's placement as training decides it (a target.ranks=first the run would refuse is refused here)
    loss, g = cfg.loss, cfg.data.generated
    topk = loss.get("teacher_topk", 0)
    distill = loss.get("distill", True) and any(loss.weights.get(n, 0) for n in DIVERGENCES)
    vllm_samples = _vllm_samples(cfg)
    stored = feature and cfg.data.get("features", "stored") == "stored" and topk and not vllm_samples
    why = _training_calls_target(cfg, feature, feature and not stored, topk or None, bool(g.enabled))
    first = _target_ranks(_target_ranks_setting(cfg), why) and ranks > 1
    precision = str(cfg.trainer.get("precision", "auto"))  # auto: what a GPU with bf16 picks (sampling/precision.py)
    teacher = "none" if not distill else "kept" if topk else "replica"
    shape = feature_head_config(target_config, draft_cfg.draft_vocab) if feature else \
        draft_config_for(target_config, draft_cfg)
    p = plan(target_config, shape, ranks, cfg.data.batch_size,
             cfg.data.block_size, devices, precision="bf16-mixed" if precision == "auto" else precision,
             compiled_loss=bool(loss.get("compile", True)), teacher=teacher, target_first=first,
             columns=draft_cfg.draft_vocab, target_bytes=4 if str(cfg.target.dtype) == "fp32" else 2,
             kept_topk=int(topk or 0), passes=draft_cfg.unroll if feature else 1)
    if feature:
        p.notes.append("feature head: one decoder layer of the target's width and its pruned head, counted as "
                       "trainable (an upper bound: the head is frozen by default), plus fc's 3h x h not counted; the "
                       f"unrolled steps (draft.unroll={draft_cfg.unroll}) each keep their activations and logits")
    if cfg.get("plan_device_gib"):
        device_gib, source = float(cfg.plan_device_gib), "plan_device_gib"
    elif torch.cuda.is_available():
        device_gib = torch.cuda.get_device_properties(0).total_memory / GIB
        source = f"this machine's {torch.cuda.get_device_name(0)}; plan_device_gib=N for another"
    else:
        device_gib, source = DEFAULT_DEVICE_GIB, "an 80 GB H100 or A100; plan_device_gib=N for another GPU"
    print_plan(p, cfg.target.name, target_config, device_gib, source, _strategy_name(cfg.trainer))
    print(fits_smaller(p))
    result = {"plan": {s: p.per_rank(s) for s in STRATEGIES}, "device_gib": device_gib}
    if g.enabled:  # the corpus' disk and the budget's hours: an estimate from the stated model (train/plan.py)
        keep = topk if loss.get("distill", True) else 0
        c = costs(p, samples=int(g.n_prompts) * int(g.samples_per_prompt),
                  epochs=float(cfg.trainer.get("max_epochs") or 1), prompt_tokens=int(cfg.data.prompt_tokens),
                  new_tokens=int(g.max_new_tokens), kept_topk=int(keep or 0),
                  kept_features=3 * target_config.hidden_size if stored else 0,
                  sampling_gpus=int(g.tensor_parallel_size) * int(g.data_parallel_size) if vllm_samples else 1,
                  teacher_pass=teacher == "replica" or (feature and not stored),
                  peak_tflops=float(cfg.plan_peak_tflops), mfu=float(cfg.plan_mfu),
                  decode_mfu=float(cfg.plan_decode_mfu))
        print_costs(c, cfg.data.get("cache_dir") or "$DRAFTSMITH_HOME (data.cache_dir)")
        result["costs"] = c.__dict__
    return result


def _strategy_name(trainer) -> str | None:
    """The plan's name for the trainer's strategy; None for one it does not size."""
    st = trainer.get("strategy", "auto")
    if isinstance(st, (dict, DictConfig)):
        target = str(st.get("_target_", ""))
        if target.endswith("DeepSpeedStrategy"):
            return f"deepspeed_stage_{st.get('stage', 2)}"
        return "fsdp" if target.endswith("FSDPStrategy") else None
    st = str(st)
    if st in ("auto", "ddp", "ddp_spawn", "single_device") or st.startswith("ddp"):
        return "ddp"  # Lightning's auto picks DDP for several devices, one device alone for one (ddp's row at 1)
    return st if st in ("deepspeed_stage_2", "deepspeed_stage_3", "fsdp") else None


def _prepare_corpus(cfg, teacher, tok, file_prompts, target_config, home: Path) -> dict:
    """What this run trains on: the corpus source and how many of its documents (a sampled corpus: the rows the
    target had written when its time box ended, with their digest, so a file grown later changes nothing). A corpus
    the target samples (or a teacher pass keeps) is written under `home` (`_corpus_dir`); `teacher()`: the target,
    loaded on first use."""
    if cfg.data.generated.enabled:
        path = _generated_corpus(cfg, teacher, tok, file_prompts, target_config, home)
    else:
        pairs = pair_rows(cfg.data.source, cfg.data.get("prompt_field", "prompt"),
                          cfg.data.get("completion_field", "completion"))
        if pairs is None:  # text: tokenized as it is, no store
            return {"source": cfg.data.source, "documents": cfg.data.max_documents, "rows": None}
        path = _imported_corpus(cfg, teacher(), tok, pairs, home)
    rows = line_count(path)
    if cfg.data.max_documents:
        rows = min(rows, cfg.data.max_documents)
    return {"source": str(path), "documents": rows, "rows": rows, "sha256": rows_digest(path, rows)}


def _feature_layers(cfg, target_config) -> list[int] | None:
    """A feature draft's target layers (what its corpus keeps besides the logits); None for an independent draft and
    for features computed online."""
    if cfg.draft.get("kind") != "feature_head" or cfg.data.get("features", "stored") == "online":
        return None
    return FeatureConfig.for_target(target_config, cfg.draft.get("feature_layers")).feature_layers


def _head_frequencies(cfg, draft_cfg, tok, token_counts: torch.Tensor) -> torch.Tensor:
    """Token frequencies that choose a pruned feature head's tokens: the training corpus', plus (equal weight)
    those of `draft.vocab_source`. A 37k-token corpus of target samples holds only 4,129 distinct tokens; with the
    stdlib's frequencies added, the top 16,384 cover 94% of held-out target samples (measured; 87% without)."""
    freq = token_counts.double() / token_counts.sum().clamp_min(1)
    if draft_cfg.draft_vocab and draft_cfg.vocab_source:
        extra = load_blocks(draft_cfg.vocab_source, tok, cfg.data.block_size, cfg.data.val_fraction, cfg.seed,
                            cfg.data.text_field)["train"]
        c = torch.bincount(extra.flatten(), minlength=len(freq)).double()
        freq = freq + c / c.sum().clamp_min(1)
    return freq


def _on_policy(cfg, tok, blocks, file_prompts) -> OnPolicy | None:
    """The on-policy share of each batch. Prompts: openings of the training blocks, or the prompts file's; wrapped
    in the chat template when asked (then the openings go through text)."""
    d, s = cfg.data, cfg.sampler
    if d.on_policy_fraction == 0:
        return None
    train = blocks["train"]
    openings = train[torch.linspace(0, len(train) - 1, min(4096, len(train))).long(), : d.prompt_tokens]
    if file_prompts is not None:
        pool = prompt_tensor(file_prompts, tok, d.prompt_tokens)
    elif d.chat_template:
        pool = prompt_tensor(prompt_texts(cfg, tok, openings), tok, d.prompt_tokens)
    else:
        pool = (openings, torch.ones_like(openings))
    return OnPolicy(d.on_policy_fraction, pool, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                    buffer=d.on_policy_buffer, seed=cfg.seed, start=d.on_policy_from)


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


def _load_target(cfg):
    """Rank 0's target may be spread over the node's GPUs (target.device_map=auto: a target no one GPU holds, there
    once for validation and the report); a replica on another rank sits on that rank's own device."""
    return load_model(cfg.target.name, cfg.target.dtype, role="teacher", device=_target_device(cfg),
                      trust_remote_code=bool(cfg.target.trust_remote_code),
                      device_map=cfg.target.device_map if detect().first else None)


def _one_run_dir(launch: Launch, out_dir: Path, cfg) -> None:
    """Every process of the job in rank 0's run dir, checked when all have met: a `hydra.run.dir` that names another
    dir on some process (a per-process interpolation, another working directory) would split the run."""
    agree(launch, "run dir", str(out_dir.resolve()), 60 * float(cfg.launch.join_minutes),
          same="give every process the same hydra.run.dir (or none: rank 0 names it for all), on storage every node "
               "shares")


def _corpus_dir(cfg, out_dir: Path, launch: Launch) -> Path:
    """Where a sampled (or teacher-passed) corpus is written and cached: `data.cache_dir` if set; else, for a run on
    one node, $DRAFTSMITH_HOME (kept across runs, resumable); for several nodes the run dir, which every node reads
    (data.json names the corpus, and $DRAFTSMITH_HOME is node-local on clusters)."""
    if cfg.data.get("cache_dir"):
        return Path(cfg.data.cache_dir).expanduser().resolve()
    if launch.nodes > 1:
        print(f"draftsmith: {launch.nodes} nodes: the corpus goes to {out_dir / 'corpus'}, which every node reads; "
              "set data.cache_dir to shared storage to keep it across runs", flush=True)
        return out_dir / "corpus"
    return cache_home()


def _corpus_wait_s(cfg) -> float:
    """How long ranks > 0 wait for rank 0's corpus: launch.wait_minutes, plus the sampling time box if any."""
    g = cfg.data.generated
    box = g.max_minutes if g.enabled and g.max_minutes else 0
    return 60 * (float(cfg.launch.wait_minutes) + float(box))


def _target_dtype(cfg) -> torch.dtype:
    """The dtype `_load_target` loads the target in (load_model's choice for `auto`), known before it loads: vLLM,
    which starts first, runs the target in it too."""
    if str(cfg.target.dtype) != "auto":
        return DTYPES[str(cfg.target.dtype)]
    cuda = _target_device(cfg).startswith("cuda") or (cfg.target.device_map and torch.cuda.is_available())
    return DTYPES[cuda_dtype() if cuda else resolve_dtype("auto", "teacher")]


def _vllm_samples(cfg) -> bool:
    """vLLM samples the target's corpus: data=generated, or data=chat's regenerated conversations."""
    d = cfg.data
    samples = d.generated.enabled or (d.get("format") == "chat" and d.get("regenerate", False))
    return bool(samples) and d.generated.get("engine", "draftsmith") == "vllm"


def _chat_engine(cfg, teacher, tok):
    """data=chat's regenerating engine, chosen when there is work for it (`chatcorpus.prepare`)."""
    return lambda rows: _corpus_engine(cfg, teacher, tok, lambda: rows)


def _target_ranks_setting(cfg) -> str:
    placement = str(cfg.target.get("ranks", "auto"))
    if placement not in ("auto", "all", "first"):
        raise DraftsmithError(f"target.ranks must be all (a replica on every rank), first (rank 0 alone; the others "
                              f"train on kept logits) or auto (first where training never calls the target), got "
                              f"{placement!r}")
    return placement


def _training_calls_target(cfg, feature: bool, online: bool, teacher_cache, kept: bool) -> str | None:
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


def _target_ranks(placement: str, why: str | None) -> bool:
    """True: the target on rank 0 alone (it validates and reports); False: a replica on every rank."""
    if placement == "first" and why:
        raise DraftsmithError(f"target.ranks=first, but training calls the target ({why}): use target.ranks=all")
    return placement == "first" or (placement == "auto" and why is None)


def _target_device(cfg) -> str:
    """The target loads straight onto this rank's device in its CUDA dtype (no CPU probe, no CPU kernels): a GPU
    trainer's rank holds the GPU of its local rank on its node, a CPU trainer the CPU."""
    acc = str(cfg.trainer.get("accelerator", "cpu"))
    if acc in ("gpu", "cuda") or (acc == "auto" and torch.cuda.is_available()):
        return f"cuda:{detect().local_rank}"
    return "cpu"


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
