"""The run's corpus: where it is written, which engine samples it, prepared once for every rank (`draftsmith data`
stops after it); and the on-policy share of each batch, whose prompts come from it."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from draftsmith.data import chatcorpus
from draftsmith.data.chat import padding_share
from draftsmith.data.corpus import (
    generate_corpus,
    load_blocks,
    pair_rows,
    sampled_rows,
    sampled_token_counts,
)
from draftsmith.data.generation import EngineCheck, choose_engine, measure_engines
from draftsmith.data.prompts import prompt_tensor, prompt_texts
from draftsmith.data.rows import line_count, rows_digest
from draftsmith.drafts.build import TargetWeights
from draftsmith.engines import vllm
from draftsmith.sampling.errors import DraftsmithError
from draftsmith.sampling.feature import FeatureConfig
from draftsmith.sampling.machine import cache_home
from draftsmith.sampling.probs import SamplingConfig
from draftsmith.sampling.prompts import pad_id, prompt_rows
from draftsmith.train import budget
from draftsmith.train.data import blocks_digest, chat_loaders, loaders, prepared_once
from draftsmith.train.launch import Launch
from draftsmith.train.onpolicy import OnPolicy
from draftsmith.train.target import load_target, target_dtype


@dataclass
class RunData:
    """What a run trains and validates on: the corpus record (data.json), its blocks (or batches of whole
    conversations), the loaders, the on-policy share, and the token counts that choose a pruned head's rows."""

    record: dict
    blocks: dict
    chat: bool
    train_dl: object
    val_dl: object
    on_policy: OnPolicy | None
    token_counts: torch.Tensor


def run_data(cfg, tok, teacher, file_prompts, target_config, out_dir: Path, launch: Launch) -> RunData:
    """The corpus, prepared once for every rank (rank 0 prepares, the others wait for its data.json), tokenized with
    the target's tokenizer; and, for a budget in epochs, the steps it makes (cfg.trainer.max_steps)."""
    chat = cfg.data.get("format") == "chat"  # conversations, one a sample (data/chatcorpus.py)
    home = corpus_dir(cfg, out_dir, launch)
    record = prepared_once(out_dir, lambda: chatcorpus.prepare(cfg, tok, teacher, home,
                                                               engine=chat_engine(cfg, teacher, tok))
                           if chat else prepare_corpus(cfg, teacher, tok, file_prompts, target_config, home),
                           corpus_wait_s(cfg), launch)
    source = record["source"]
    if chat:
        blocks = chatcorpus.chat_blocks(cfg, tok, record)
        print(f"draftsmith: rank {launch.rank} trains on {len(blocks['train'])} batches of whole conversations of "
              f"{source} ({padding_share(blocks['train']):.0%} padding)", flush=True)
        train_dl, val_dl = chat_loaders(blocks, cfg)
        policy = None
        token_counts = chatcorpus.token_counts(blocks, target_config.vocab_size)
    else:
        blocks = load_blocks(source, tok, cfg.data.block_size, cfg.data.val_fraction, cfg.seed, cfg.data.text_field,
                             record["documents"], rows=cfg.data.get("rows", "stream"))
        print(f"draftsmith: rank {launch.rank} trains on "
              f"{len(blocks['train'])} blocks of {source}, sha256 {blocks_digest(blocks)}", flush=True)
        train_dl, val_dl = loaders(blocks, cfg)
        policy = on_policy(cfg, tok, blocks, file_prompts)
        token_counts = (sampled_token_counts(blocks, sampled_rows(source) or [], target_config.vocab_size)
                        if cfg.draft.get("vocab_count") == "sampled"  # the target's own tokens alone
                        else torch.bincount(blocks["train"].flatten(), minlength=target_config.vocab_size))
    # a chat item is a whole batch already (train/data.py chat_loaders): one item a micro-batch
    per_step = 1 if chat else int(cfg.data.batch_size)
    steps = budget.derived_steps(cfg, len(blocks["train"]), launch.world_size, per_step)
    if steps is not None:  # a budget in epochs: the LR schedule and the progress need its steps
        print(f"draftsmith: budget {budget.budget_line(cfg)}: {record.get('rows') or 'the corpus'} samples in "
              f"{len(blocks['train'])} {'batches of whole conversations' if chat else 'blocks'} of "
              f"{cfg.data.block_size} tokens, {launch.world_size} rank(s) x micro-batch {cfg.data.batch_size}: "
              f"{steps} steps", flush=True)
        cfg.trainer.max_steps = steps
    return RunData(record, blocks, chat, train_dl, val_dl, policy, token_counts)


def prepare_corpus(cfg, teacher, tok, file_prompts, target_config, home: Path) -> dict:
    """What this run trains on: the corpus source and how many of its documents (a sampled corpus: the rows the
    target had written when its time box ended, with their digest, so a file grown later changes nothing). A corpus
    the target samples (or a teacher pass keeps) is written under `home` (`corpus_dir`); `teacher()`: the target,
    loaded on first use."""
    if cfg.data.generated.enabled:
        path = generated_corpus(cfg, teacher, tok, file_prompts, target_config, home)
    else:
        pairs = pair_rows(cfg.data.source, cfg.data.get("prompt_field", "prompt"),
                          cfg.data.get("completion_field", "completion"))
        if pairs is None:  # text: tokenized as it is, no store
            return {"source": cfg.data.source, "documents": cfg.data.max_documents, "rows": None}
        path = imported_corpus(cfg, teacher(), tok, pairs, home)
    rows = line_count(path)
    if cfg.data.max_documents:
        rows = min(rows, cfg.data.max_documents)
    return {"source": str(path), "documents": rows, "rows": rows, "sha256": rows_digest(path, rows)}


def generated_corpus(cfg, teacher, tok, file_prompts, target_config, home: Path):
    """`data=generated`: the target samples continuations of the prompts once; cached and resumable. `teacher()`
    returns the target, loading it on first use: vLLM needs it only for its check, after its own start."""
    g = cfg.data.generated
    prompts, name = generated_key(cfg, tok, file_prompts)
    keep = cfg.loss.get("teacher_topk", 0) if cfg.loss.get("distill", True) else 0
    kw = corpus_engine(cfg, teacher, tok, lambda: prompt_rows(tok, prompts[: g.batch_size]))
    engine = kw.pop("engine")
    if engine == "vllm":  # its own seeds: its samples extend its own file, never ours
        name += "-vllm"
    path = home / "generated" / f"{name}.jsonl"
    s = cfg.sampler
    return generate_corpus(None if engine == "vllm" else teacher(), tok, prompts, path,
                           samples_per_prompt=g.samples_per_prompt, max_new_tokens=g.max_new_tokens,
                           temperature=s.temperature, top_p=s.top_p, batch_size=g.batch_size, seed=cfg.seed,
                           max_seconds=None if g.max_minutes is None else 60 * g.max_minutes,
                           keep_logits=keep, keep_features=feature_layers(cfg, target_config) if keep else None,
                           engine=engine, data_parallel_size=g.get("data_parallel_size", 1), **kw)


def imported_corpus(cfg, target, tok, pairs, home: Path) -> Path:
    """`data.source=` prompt + completion pairs sampled elsewhere: one teacher pass writes them to the same store as
    our own samples (the kept logits, a feature draft's features), once; cached by the file and the settings."""
    src = Path(cfg.data.source).expanduser().resolve()
    st = src.stat()
    keep = cfg.loss.get("teacher_topk", 0) if cfg.loss.get("distill", True) else 0
    layers = feature_layers(cfg, target.config) if keep else None
    key = hashlib.sha256(json.dumps([str(src), st.st_size, int(st.st_mtime), cfg.data.get("prompt_field"),
                                     cfg.data.get("completion_field"), keep, layers]).encode()).hexdigest()[:12]
    path = home / "imported" / f"{cfg.target.name.replace('/', '_')}-{src.stem}-{key}.jsonl"
    prompts, completions = pairs
    return generate_corpus(target, tok, prompts, path, batch_size=8, seed=cfg.seed, keep_logits=keep,
                           keep_features=layers, completions=completions)


def generated_key(cfg, tok, file_prompts) -> tuple[list[str], str]:
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


def corpus_engine(cfg, teacher, tok, rows) -> dict:
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
    dtype = target_dtype(cfg)
    check = EngineCheck("vllm", teacher, tok, SamplingConfig(s.temperature, 0, s.top_p), cfg.target.name, dtype,
                        seed=cfg.seed)
    return {"engine": "vllm", "check": check, "dtype": dtype, "target_name": cfg.target.name, **vllm_kw}


def chat_engine(cfg, teacher, tok):
    """data=chat's regenerating engine, chosen when there is work for it (`chatcorpus.prepare`)."""
    return lambda rows: corpus_engine(cfg, teacher, tok, lambda: rows)


def vllm_samples(cfg) -> bool:
    """vLLM samples the target's corpus: data=generated, or data=chat's regenerated conversations."""
    d = cfg.data
    samples = d.generated.enabled or (d.get("format") == "chat" and d.get("regenerate", False))
    return bool(samples) and d.generated.get("engine", "draftsmith") == "vllm"


def feature_layers(cfg, target_config) -> list[int] | None:
    """A feature draft's target layers (what its corpus keeps besides the logits); None for an independent draft and
    for features computed online."""
    if cfg.draft.get("kind") != "feature_head" or cfg.data.get("features", "stored") == "online":
        return None
    return FeatureConfig.for_target(target_config, cfg.draft.get("feature_layers")).feature_layers


def corpus_dir(cfg, out_dir: Path, launch: Launch) -> Path:
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


def corpus_wait_s(cfg) -> float:
    """How long ranks > 0 wait for rank 0's corpus: launch.wait_minutes, plus the sampling time box if any."""
    g = cfg.data.generated
    box = g.max_minutes if g.enabled and g.max_minutes else 0
    return 60 * (float(cfg.launch.wait_minutes) + float(box))


def check_prepared(cfg, tok, file_prompts, out_dir: Path, launch: Launch) -> None:
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
    prompts, name = generated_key(cfg, tok, file_prompts)
    want = len(prompts) * int(g.samples_per_prompt)
    home = corpus_dir(cfg, out_dir, launch)
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


def prepare_only(cfg, tok, file_prompts, out_dir: Path, launch: Launch) -> dict:
    """`draftsmith data`: prepare the corpus where `train` will look for it (resumable: a rerun continues), then stop.
    Conversations (data=chat) also print `data.show` rendered samples with their trained tokens marked; continuations
    the target samples (data=generated, a GPU recipe's corpus) go to the file `check_prepared` checks."""
    target = []

    def teacher():  # the target, loaded on first use (vLLM samples without it)
        if not target:
            target.append(load_target(cfg))
        return target[0]

    if cfg.data.get("format") != "chat":
        if not cfg.data.generated.enabled:
            raise DraftsmithError("draftsmith data prepares what the target writes: add data=chat (conversations, "
                                  "data.source=FILE or sharegpt) or data=generated (continuations of prompts)")
        if vllm_samples(cfg):
            vllm.ready(cfg.target.name)  # no vLLM, or a target it cannot run: refused before any work
        weights = TargetWeights.of(cfg.target.name, bool(cfg.target.trust_remote_code))
        record = prepare_corpus(cfg, teacher, tok, file_prompts, (weights or teacher()).config,
                                 corpus_dir(cfg, out_dir, launch))
        print(f"draftsmith: the corpus is ready: {record['rows']} samples in {record['source']}; draftsmith train "
              "with the same overrides uses it", flush=True)
        return record
    if vllm_samples(cfg):
        vllm.ready(cfg.target.name)  # no vLLM, or a target it cannot run: refused before any work
    record = chatcorpus.prepare(cfg, tok, teacher, corpus_dir(cfg, out_dir, launch),
                                engine=chat_engine(cfg, teacher, tok))
    blocks = chatcorpus.chat_blocks(cfg, tok, record)
    n = sum(len(b["ids"]) for b in blocks["train"])
    print(f"draftsmith: the corpus is ready: {n} conversations of {record['source']} in {len(blocks['train'])} "
          f"batches ({padding_share(blocks['train']):.0%} padding); draftsmith train with the same overrides uses it")
    chatcorpus.print_samples(tok, blocks, cfg.data.get("show", 0))
    return record


def on_policy(cfg, tok, blocks, file_prompts) -> OnPolicy | None:
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
