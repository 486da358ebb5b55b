"""`data=chat`: the conversations a run trains on, prepared once (by `draftsmith data` or the first `train`).

- The source's held-out split (`conversations.assign_splits`, by conversation) is never trained on or
  regenerated. Its validation half (where a small source holds fewer than the validation needs, the next-lowest
  hashed training conversations join it, whole) gives the validation prompts, `val/alpha_on_target` among them (the
  target's own answers, its tokens only scored), which pick the checkpoint; its benchmark half is left to the
  benchmarks (`bench serve`, `bench acceptance`, the card), so no figure they print was used to choose.
- `data.regenerate=true`: the target answers again, turn by turn, through its chat template, with its own earlier
  answers as context (`regenerate`), by the generated corpus' engine (data.generated.engine: our sampler's plain loop,
  or vLLM judged by the same chi-square before anything is kept; `data/generation.py` row_sampler), every prompt
  rendered here by our tokenizer and template and handed over as token ids; at most `data.max_turns` assistant turns a
  conversation (what follows the last regenerated one is dropped: its context would no longer be what the target
  said), each at most `data.turn_max_new_tokens`. Written one conversation a line, resumable at conversation
  granularity, time-boxed by data.generated.max_minutes, a full disk said in one line with nothing written lost.
- `data.regenerate=false`: the conversations as they are (already the target's own answers, or the data to
  imitate).
- `loss.teacher_topk=K` (`keep_teacher`): after that, one teacher pass keeps the target's top-K logits at every
  assistant label of every training sample, in the generated corpus' store (data/corpus.py `keep_label_logits`:
  resumable, a full disk said in one line), so no training step runs the target. A feature draft reads the target's
  features at every context token, which this store does not keep: it keeps its pass in every step.
The corpus is keyed by a fingerprint of the source's files, the tokenizer and these settings, under the run's corpus
folder (`chat_path`: data.cache_dir, else $DRAFTSMITH_HOME, or the run dir every node reads on several nodes; as
the generated corpus), so `train` finds what `data` prepared.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from draftsmith.data.chat import PROMPT_TOO_LONG, chat_batches, cut, last_turn_only, render, show, template_text
from draftsmith.data.conversations import (
    Conversation,
    Fields,
    assign_splits,
    read_conversations,
    source_files,
    split_key,
)
from draftsmith.data.diskfull import disk_full
from draftsmith.sampling.errors import DraftsmithError


def fields_of(cfg) -> Fields:
    f = cfg.data.get("fields") or {}
    return Fields(**{k: v for k, v in dict(f).items() if v is not None})


_reported: set[str] = set()  # sources whose skipped rows this process has said


def split(cfg) -> tuple[list[Conversation], list[Conversation]]:
    """(training, validation) conversations of `data.source`, deterministic, disjoint, and neither holding a piece
    of the benchmark half or of a conversation the other holds."""
    d = cfg.data
    convs = read_conversations(d.source, fields_of(cfg), split="all", quiet=d.source in _reported)
    _reported.add(d.source)
    parts = assign_splits(convs)
    need = max(2, cfg.sampler.on_target_prompts, cfg.sampler.n_prompts)
    held = [c for c, p in zip(convs, parts) if p == "validation"]
    train = [c for c, p in zip(convs, parts) if p == "train"]
    if len(held) < need:  # a small file: whole training conversations by their hash, so the choice is still it
        groups: dict[str, list[Conversation]] = {}
        for c in train:
            groups.setdefault(split_key(c), []).append(c)
        ranked = sorted(groups, key=lambda key: hashlib.sha256(key.encode()).digest())
        taken = []
        for key in ranked:
            if len(held) >= need or len(taken) + len(groups[key]) > len(train) // 2:
                break
            held += groups[key]
            taken += groups[key]
        ids = {id(c) for c in taken}
        train = [c for c in train if id(c) not in ids]
    if d.max_documents:
        train = train[: d.max_documents]
    return train, held


def chat_path(cfg, tok, home: Path, engine: str = "draftsmith") -> Path:
    """Where the regenerated conversations of these settings are kept under the corpus folder `home` (their
    fingerprint); vLLM's (`engine`) in a file of their own, as the generated corpus keeps them: its answers never
    continue a file our loop began, nor the other way round."""
    d, s = cfg.data, cfg.sampler
    h = hashlib.sha256()
    for f in source_files(d.source):
        st = f.stat()
        h.update(f"{f}:{st.st_size}:{int(st.st_mtime)}".encode())
    h.update(json.dumps([d.source, dict(d.get("fields") or {}), d.enable_thinking, d.max_turns, d.turn_max_new_tokens,
                         d.block_size, d.max_documents, s.temperature, s.top_p, cfg.seed, cfg.target.name,
                         tok.chat_template]).encode())
    suffix = "-vllm" if engine == "vllm" else ""
    return Path(home) / "chat" / f"{cfg.target.name.replace('/', '_')}-{h.hexdigest()[:16]}{suffix}.jsonl"


def prepare(cfg, tok, teacher, home: Path, progress: bool = True, engine=None) -> dict:
    """The corpus record (as train/data.py `prepared_once` keeps it): the regenerated file under the corpus folder
    `home`, or the source as is. `engine(rows)`: the engine that regenerates (data.generated.engine, `auto` measured
    on `rows`, the first conversations' first prompts) as `regenerate`'s keyword arguments (train/draft.py
    `_corpus_engine`); None: our loop. `teacher()` loads the target: vLLM needs it only for its check."""
    d = cfg.data
    if not d.regenerate:
        record = {"source": d.source, "documents": d.max_documents, "rows": None, "format": "chat",
                  "enable_thinking": d.enable_thinking}
        return keep_teacher(cfg, tok, teacher, home, record, progress)
    train, _ = split(cfg)
    g = cfg.data.generated
    first = [_first_prompt(tok, c, d.enable_thinking) for c in train[: g.batch_size]]
    kw = engine([r for r in first if r]) if engine is not None and any(first) else {"engine": "draftsmith"}
    path = chat_path(cfg, tok, home, kw["engine"])
    regenerate(None if kw["engine"] == "vllm" else teacher(), tok, train, path, enable_thinking=d.enable_thinking,
               max_turns=d.max_turns, max_new_tokens=d.turn_max_new_tokens, batch_size=g.batch_size,
               temperature=cfg.sampler.temperature, top_p=cfg.sampler.top_p, seed=cfg.seed, progress=progress,
               max_seconds=None if g.max_minutes is None else 60 * g.max_minutes, max_prompt_tokens=d.block_size - 1,
               **kw)
    from draftsmith.data.rows import line_count, rows_digest

    rows = line_count(path)
    record = {"source": str(path), "documents": rows, "rows": rows, "sha256": rows_digest(path, rows),
              "format": "chat", "enable_thinking": d.enable_thinking}
    return keep_teacher(cfg, tok, teacher, home, record, progress)


def kept_topk(cfg) -> int:
    """The K of the target's top-K logits data=chat keeps (0: none): loss.teacher_topk when the loss distills, for
    an independent draft (a feature draft also reads the target's features at every context token, which are not
    kept here: it runs the target in every step)."""
    if not cfg.loss.get("distill", True) or cfg.draft.get("kind") == "feature_head":
        return 0
    return int(cfg.loss.get("teacher_topk", 0) or 0)


def keep_teacher(cfg, tok, teacher, home: Path, record: dict, progress: bool = True) -> dict:
    """`record` with `kept` (the store of the target's top-K logits at every assistant label of every training
    sample, `keep_label_logits`) and `kept_topk`, when loss.teacher_topk asks for them: one teacher pass, cached
    under `home` by the samples' tokens, the target and K (so a rerun, or `train` after `draftsmith data`, reuses
    it, and a pass cut short continues)."""
    k = kept_topk(cfg)
    if not k:
        return record
    from draftsmith.data.corpus import keep_label_logits
    from draftsmith.sampling.prompts import pad_id

    rows = label_rows(training_samples(cfg, tok, record, Counter()))
    h = hashlib.sha256(json.dumps([cfg.target.name, str(cfg.target.dtype), k]).encode())
    for r in rows:
        h.update(json.dumps(r).encode())
    path = Path(home) / "chat" / "kept" / f"{cfg.target.name.replace('/', '_')}-top{k}-{h.hexdigest()[:16]}.jsonl"
    keep_label_logits(teacher(), rows, path, keep_logits=k, batch_size=int(cfg.data.batch_size), pad=pad_id(tok),
                      progress=progress)
    return {**record, "kept": str(path), "kept_topk": k}


def label_rows(samples: list) -> list[dict]:
    """Each training sample as the kept store holds it: its tokens and the positions whose label is trained (the
    logits there are what the loss reads)."""
    return [{"ids": list(x.ids), "at": [p for p in range(len(x.ids) - 1) if x.trained[p + 1]]} for x in samples]


def _first_prompt(tok, c: Conversation, enable_thinking) -> list[int]:
    k = _next_assistant(c.messages, 0, None)
    return [] if k is None else tok(template_text(tok, c.messages[:k], True, enable_thinking),
                                    add_special_tokens=False)["input_ids"]


def regenerate(target, tok, convs: list[Conversation], out_path: Path, *, enable_thinking=None, max_turns=None,
               max_new_tokens: int = 256, batch_size: int = 8, temperature: float = 0.8, top_p: float = 1.0,
               seed: int = 0, progress: bool = True, max_seconds: float | None = None,
               max_prompt_tokens: int | None = None, engine: str = "draftsmith", **engine_kw) -> Path:
    """Each conversation's assistant turns answered again by the target, turn by turn, `batch_size` conversations
    at a time (their k-th turns sampled together), into a JSONL of {"id", "messages", "regenerated"}; rows already in
    the file are kept and the work continues after them. A conversation stops before a turn whose prompt holds
    `max_prompt_tokens` or more (training cuts it away: ShareGPT's prompts run to thousands of tokens); one with no
    turn regenerated is written with `regenerated` 0 and left out of training. Every prompt is rendered here, by our
    tokenizer and the target's template, whichever engine samples it (`engine`: `draftsmith`, our loop on `target`;
    `vllm`, started once for the whole file and judged before anything is kept, `engine_kw` its settings:
    data/generation.py `row_sampler`)."""
    from tqdm import tqdm

    from draftsmith.data.corpus import _complete_rows
    from draftsmith.data.generation import row_sampler
    from draftsmith.sampling.prompts import pad_id

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done = _complete_rows(out_path, 1, len(convs))
    if done >= len(convs):
        return out_path  # nothing to sample: no engine is started
    new_tokens, written = 0, [done]
    name = "vLLM" if engine == "vllm" else "our loop"
    full = disk_full("the regenerated conversations", out_path, then=lambda: (
        f"free space or point DRAFTSMITH_HOME at a larger disk, and rerun: the {written[0]} conversations written "
        "are kept and regeneration continues after them"))
    sampler = row_sampler(engine, target, batch_size=batch_size, max_new_tokens=max_new_tokens,
                          temperature=temperature, top_p=top_p, eos=tok.eos_token_id, pad=pad_id(tok), seed=seed,
                          max_model_len=None if max_prompt_tokens is None else max_prompt_tokens + max_new_tokens + 8,
                          **engine_kw)
    with full, sampler as sample, out_path.open("a") as f, tqdm(
            total=len(convs), initial=done, disable=not progress,
            desc=f"conversations regenerated by the target ({engine})") as bar:
        t0 = time.perf_counter()  # after vLLM's start, which it reports itself: the box and the rate are sampling's
        for lo in range(done, len(convs), batch_size):
            group = [[dict(m) for m in c.messages] for c in convs[lo: lo + batch_size]]
            answered, stopped = [0] * len(group), [False] * len(group)
            turn = 0
            while True:
                # each conversation's next assistant turn to answer (its index), or None
                at = [_next_assistant(m, answered[j], max_turns) for j, m in enumerate(group)]
                texts = {j: template_text(tok, group[j][: k], True, enable_thinking) for j, k in enumerate(at)
                         if k is not None and not stopped[j]}
                for j, t in texts.items():  # a turn whose prompt fills the block would be cut away in training
                    stopped[j] = not _fits(tok, t, max_prompt_tokens)
                todo = [j for j in texts if not stopped[j]]
                if not todo:
                    break
                rows = [tok(texts[j], add_special_tokens=False)["input_ids"] for j in todo]
                # the turn's rows in one call: the next turn's prompts need these answers
                for start, _, tokens, _, _ in sample(rows, seed + 7919 * turn, lo):
                    for j, toks in zip(todo[start:], tokens):
                        group[j][at[j]]["content"] = tok.decode(toks, skip_special_tokens=True)
                        answered[j] += 1
                        new_tokens += len(toks)
                turn += 1
            for j, msgs in enumerate(group):
                keep = _through_answered(msgs, answered[j])
                f.write(json.dumps({"id": convs[lo + j].id, "messages": keep, "regenerated": answered[j]}) + "\n")
            f.flush()
            written[0] = lo + len(group)
            bar.update(len(group))
            bar.set_postfix_str(f"{new_tokens / (time.perf_counter() - t0):.1f} tokens/s", refresh=False)
            if max_seconds is not None and time.perf_counter() - t0 > max_seconds and written[0] < len(convs):
                bar.write(f"regeneration: {max_seconds / 60:.2g} min spent (data.generated.max_minutes), stopping at "
                          f"{written[0]} of {len(convs)} conversations; a rerun continues the cached file")
                break
        seconds = time.perf_counter() - t0
    if new_tokens:
        print(f"draftsmith: regeneration: {new_tokens} tokens in {seconds:.1f} s "
              f"({new_tokens / max(1e-9, seconds):.1f} tokens/s, {name})", file=sys.stderr)
    return out_path


def _next_assistant(messages: list[dict], answered: int, max_turns: int | None) -> int | None:
    if max_turns is not None and answered >= max_turns:
        return None
    idx = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    return idx[answered] if answered < len(idx) else None


def _fits(tok, text: str, max_prompt_tokens: int | None) -> bool:
    return max_prompt_tokens is None or len(tok(text, add_special_tokens=False)["input_ids"]) < max_prompt_tokens


def _through_answered(messages: list[dict], answered: int) -> list[dict]:
    """The conversation up to and including its last regenerated assistant turn."""
    idx = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    return messages[: idx[answered - 1] + 1] if answered else messages


def regenerated(path: Path, rows: int, counts: Counter) -> list[Conversation]:
    """The first `rows` conversations of a `regenerate` file that have a regenerated turn (the others counted)."""
    out = []
    with open(path) as f:
        for _, line in zip(range(rows), f):
            row = json.loads(line)
            if row["regenerated"]:
                out.append(Conversation(row["id"], row["messages"]))
            else:
                counts[PROMPT_TOO_LONG] += 1
    return out


def _samples(cfg, tok, convs, counts: Counter) -> list:
    d = cfg.data
    out = []
    for c in convs:
        x = render(tok, c.messages, d.enable_thinking)
        x = last_turn_only(x) if d.last_turn_only else x
        x = cut(x, d.block_size, counts)
        if x is not None:
            out.append(x)
    return out


def training_samples(cfg, tok, record: dict, counts: Counter) -> list:
    """The prepared corpus' training samples (data/chat.py `Sample`), in the order `chat_blocks` numbers them."""
    if record.get("rows") is None:
        train, _ = split(cfg)
    else:
        train = regenerated(Path(record["source"]), record["documents"], counts)
    return _samples(cfg, tok, train, counts)


def chat_blocks(cfg, tok, record: dict) -> dict:
    """{"train": [batch], "val": [batch], "prompts": (ids, mask), "counts": Counter, "samples": [Sample]} of the
    prepared corpus: every conversation rendered, cut to data.block_size, batched per sample (data/chat.py); a
    batch's "rows" index `samples`."""
    d, s = cfg.data, cfg.sampler
    _, held = split(cfg)
    counts = Counter()
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    train_s, val_s = training_samples(cfg, tok, record, counts), _samples(cfg, tok, held, counts)
    if len(train_s) < d.batch_size:
        raise DraftsmithError(f"data.source={d.source}: {len(train_s)} conversations fit data.block_size="
                              f"{d.block_size}, fewer than one batch of {d.batch_size}: add conversations or raise "
                              "data.block_size")
    for kind, n in sorted(counts.items()):
        print(f"draftsmith: {n} conversation{'s' * (n != 1)}: {kind}", file=sys.stderr)
    prompts = [template_text(tok, c.messages[: next(k for k, m in enumerate(c.messages) if m["role"] == "assistant")],
                             True, d.enable_thinking) for c in held]
    from draftsmith.data.prompts import prompt_tensor

    return {"train": chat_batches(train_s, d.batch_size, pad, seed=cfg.seed),
            "val": chat_batches(val_s, d.batch_size, pad, seed=cfg.seed)[: max(1, d.val_blocks // d.batch_size)],
            "prompts": prompt_tensor(prompts, tok, s.prompt_tokens + 64), "counts": counts, "samples": train_s}


def print_samples(tok, blocks: dict, n: int) -> None:
    """`draftsmith data --show N`: N rendered training samples, the trained tokens between ⟦ and ⟧."""
    shown = 0
    for b in blocks["train"]:
        for row in range(len(b["ids"])):
            if shown == n:
                return
            print(f"--- sample {shown + 1} ({int(b['mask'][row].sum())} tokens, "
                  f"{int(b['loss_mask'][row].sum())} trained) ---\n{show(tok, b, row)}")
            shown += 1


def token_counts(blocks: dict, vocab: int) -> torch.Tensor:
    ids = torch.cat([b["ids"][b["mask"].bool()] for b in blocks["train"]])
    return torch.bincount(ids, minlength=vocab)
