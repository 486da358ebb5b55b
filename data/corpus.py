"""The target's corpus as packed token blocks: load through `datasets`, tokenize with the target's tokenizer,
split train/val by document, pack, cache.

Sources (`data.source`):
- `stdlib`: the Python standard library's own source (the embedded default; code is the domain where the paper
  found speculative sampling friendliest);
- a local dataset directory (`save_to_disk` output or a folder of data files), a .txt/.jsonl/.json/.parquet/.py
  file or glob, or a `datasets` hub id;
- `generated`: continuations sampled by the target itself at the deployment temperature (DistillSpec found
  on-policy data the best for alignment); see `generate_corpus`.
"""

from __future__ import annotations

import glob
import hashlib
import json
import time
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from draftsmith.data.diskfull import disk_full
from draftsmith.sampling.errors import DraftsmithError
from draftsmith.sampling.machine import atomic_path, cache_home
from draftsmith.sampling.names import stdlib_sources

_BUILDERS = {".txt": "text", ".py": "text", ".md": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet",
             ".csv": "csv"}


_POS_BITS = 20  # a sample's token's pointer: row << 20 | its position in the row (a row is far shorter than 2**20)


def _documents(source: str, text_field: str, max_documents: int | None) -> list[str]:
    import datasets

    datasets.disable_progress_bars()
    if source == "stdlib":
        files = [str(f) for f in stdlib_sources()]
        ds = datasets.load_dataset("text", data_files={"train": files}, sample_by="document", split="train")
    else:
        path = Path(source).expanduser()
        files = sorted(glob.glob(str(path), recursive=True)) if any(c in source for c in "*?[") else []
        if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "state.json").exists()):
            ds = datasets.load_from_disk(str(path))
            ds = ds["train"] if isinstance(ds, datasets.DatasetDict) else ds
        elif path.is_dir() or path.is_file() or files:
            if path.is_dir():
                files = sorted(str(f) for f in path.rglob("*") if f.suffix in _BUILDERS)
            elif path.is_file():
                files = [str(path)]
            if not files:
                raise DraftsmithError(f"no data files ({', '.join(_BUILDERS)}) under {source}")
            suffixes = {Path(f).suffix for f in files}
            builders = {_BUILDERS.get(s) for s in suffixes}
            if None in builders or len(builders) != 1:
                raise DraftsmithError(f"mixed or unsupported file types {sorted(suffixes)} in {source}; "
                                      f"use one of {', '.join(_BUILDERS)}")
            builder = builders.pop()
            kw = {"sample_by": "document"} if builder == "text" else {}
            try:
                ds = datasets.load_dataset(builder, data_files={"train": files}, split="train", **kw)
            except Exception as e:  # invalid UTF-8, a broken JSON line, a cut parquet: name the files, one line
                first = (str(e).strip().splitlines() or [""])[0][:160]
                cause = e.__cause__ or e.__context__
                why = f"{type(cause).__name__}: {str(cause)[:160]}" if cause else f"{type(e).__name__}: {first}"
                where = files[0] if len(files) == 1 else f"{len(files)} files under {source}"
                raise DraftsmithError(f"could not read corpus {where} as {builder} ({why}); fix or remove the "
                                      "damaged file") from None
        elif source.startswith((".", "/", "~")) or source.count("/") > 1:
            raise DraftsmithError(f"corpus not found: {source}")
        else:
            try:
                ds = datasets.load_dataset(source, split="train")
            except Exception as e:
                raise DraftsmithError(f"could not load dataset {source!r} ({type(e).__name__}: {str(e)[:120]}); "
                                      "pass a local directory or data files") from None
    if text_field not in ds.column_names:
        raise DraftsmithError(f"corpus {source} has no '{text_field}' column (it has {ds.column_names}); "
                              "set data.text_field")
    if max_documents:
        ds = ds.select(range(min(max_documents, len(ds))))
    return [t for t in ds[text_field] if t and t.strip()]


def _fingerprint(source, tokenizer, *parts) -> str:
    h = hashlib.sha256()
    h.update(repr(parts).encode())
    h.update(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode())
    if source == "stdlib":
        for f in stdlib_sources():
            st = f.stat()
            h.update(f"{f}:{st.st_size}:{int(st.st_mtime)}".encode())
    else:
        p = Path(source).expanduser()
        for f in ([p] if p.is_file() else sorted(p.rglob("*")) if p.is_dir() else []):
            st = f.stat()
            h.update(f"{f}:{st.st_size}:{int(st.st_mtime)}".encode())
        h.update(source.encode())
    return h.hexdigest()[:16]


def pair_rows(source: str, prompt_field: str = "prompt", completion_field: str = "completion"):
    """(prompts, completions) of a JSONL, JSON or parquet file of prompt + completion pairs generated anywhere,
    rows with an empty side dropped; None when `source` is not such a file (plain text, or our own samples)."""
    path = Path(str(source)).expanduser()
    if path.suffix not in (".jsonl", ".json", ".parquet") or not path.is_file():
        return None
    import datasets

    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset("parquet" if path.suffix == ".parquet" else "json", data_files=str(path),
                                   split="train")
    except Exception:
        return None  # not a table: the text reader names the damage
    if prompt_field not in ds.column_names or completion_field not in ds.column_names:
        return None
    pairs = [(p, c) for p, c in zip(ds[prompt_field], ds[completion_field]) if p and c]
    if not pairs:
        raise DraftsmithError(f"{source} has no row with both a '{prompt_field}' and a '{completion_field}'")
    return [p for p, _ in pairs], [c for _, c in pairs]


def sampled_rows(source: str) -> list[dict] | None:
    """The rows of a `generate_corpus` file (a JSONL whose rows carry `ids`), else None: its tokens are taken as
    sampled, not re-tokenized from text (decoding and encoding again need not give the same tokens, and the kept
    logits belong to the sampled ones). Rows written before `ids` existed are tokenized from their text."""
    path = Path(source).expanduser()
    if path.suffix != ".jsonl" or not path.is_file():
        return None
    try:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except ValueError:
        return None  # not ours: the datasets reader names the damage
    return rows if any(isinstance(r, dict) and "ids" in r for r in rows) else None


def _sampled_tokens(tokenizer, row: dict, r: int) -> tuple[list[int], list[int]]:
    """A sample's tokens and, per position, a pointer (row << 20 | position) to what the target kept there
    (`prefill_teacher`), -1 at the EOS seam after the sample and for a row written before `ids` existed."""
    if "ids" not in row:
        ids = tokenizer(row["text"], add_special_tokens=False)["input_ids"]
        return ids, [-1] * (len(ids) + 1)
    ids = row["ids"]
    return ids, [r << _POS_BITS | p for p in range(len(ids))] + [-1]  # + the EOS that ends the document


ROWS = ("stream", "sample", "packed")  # data.rows: how the training split's samples become rows (`load_blocks`)


def blocks_cache(source: str, tokenizer, block_size: int, val_fraction: float = 0.03, seed: int = 0,
                 text_field: str = "text", max_documents: int | None = None, rows: str = "stream") -> Path:
    """Where `load_blocks` caches the blocks of these arguments (the corpus' files' sizes and times included)."""
    parts = (block_size, val_fraction, seed, text_field, max_documents, "row-positions")  # train_src's format:
    # pointers to (row, position), not (row, step); a layout other than the stream is a file of its own
    key = _fingerprint(source, tokenizer, *parts, *(() if rows == "stream" else (f"rows={rows}",)))
    return cache_home() / "corpus" / f"{key}.safetensors"


def _sample_rows(ids, src, block_size: int, eos: int, per_row: int | None) -> dict[str, torch.Tensor]:
    """Whole samples as rows of `block_size` (data.rows=sample: one a row, `per_row`=1; packed: as many as fit,
    first fit), right-padded with EOS. 'train_pos' holds each token's position in its own sample (0 at its first
    token), -1 on padding: a packed row's positions restart at each sample, which transformers turns into one
    causal mask per sample (its packed-sequence check on position ids). A sample longer than a row is cut to the
    row: its tail, which would open another row without its prompt, is dropped."""
    docs = [(list(d) + [eos])[:block_size] for d in ids]
    srcs = [list(s)[:block_size] for s in src]
    rows: list[list[int]] = []
    free: list[int] = []
    for i, d in enumerate(docs):  # first fit, in the corpus' (shuffled) order
        at = next((r for r, f in enumerate(free) if f >= len(d) and (per_row is None or len(rows[r]) < per_row)),
                  None)
        if at is None:
            rows.append([])
            free.append(block_size)
            at = len(rows) - 1
        rows[at].append(i)
        free[at] -= len(d)
    out = {name: torch.full((len(rows), block_size), fill, dtype=torch.long)
           for name, fill in (("train", eos), ("train_src", -1), ("train_pos", -1))}
    for r, members in enumerate(rows):
        col = 0
        for i in members:
            n = len(docs[i])
            out["train"][r, col: col + n] = torch.tensor(docs[i])
            out["train_src"][r, col: col + n] = torch.tensor(srcs[i])
            out["train_pos"][r, col: col + n] = torch.arange(n)
            col += n
    return out


def load_blocks(source: str, tokenizer, block_size: int, val_fraction: float = 0.03, seed: int = 0,
                text_field: str = "text", max_documents: int | None = None, min_val_blocks: int = 2,
                min_train_blocks: int = 8, rows: str = "stream") -> dict[str, torch.Tensor]:
    """{'train': (N, block_size), 'val': (M, block_size)} LongTensors, cached under $DRAFTSMITH_HOME/corpus; for a
    `generate_corpus` file also 'train_src' (N, block_size): where each position's kept target logits are
    (`prefill_teacher`).

    `rows` (data.rows) lays out the training split: `stream` joins every sample with EOS into one stream cut into
    blocks (a ~215-token sample straddles two 256-token blocks, so a block's first positions lack their prompt, while
    the target's kept logits were computed with it); `sample` puts each sample in a row of its own from position
    0, `packed` as many whole samples as fit in a row, positions restarting per sample (speculators' packing). Both
    add 'train_pos' (`_sample_rows`) and need a corpus of samples (data=generated, or prompt + completion pairs).
    The held-out split stays a stream in every layout, so val/alpha_analytic compares across layouts."""
    if block_size < 2:
        raise DraftsmithError(f"data.block_size must be >= 2, got {block_size}")
    if rows not in ROWS:
        raise DraftsmithError(f"data.rows must be one of {', '.join(ROWS)}, got {rows!r}")
    path = blocks_cache(source, tokenizer, block_size, val_fraction, seed, text_field, max_documents, rows)
    if path.is_file():
        try:
            return load_file(path)
        except Exception as e:  # written whole by rename, so only damage on disk gets here: it is a cache
            import warnings

            warnings.warn(f"{path} is damaged ({type(e).__name__}): rebuilding it from {source}")
            path.unlink()
    layout, rows = rows, sampled_rows(source)
    if rows is None:
        if layout != "stream":
            raise DraftsmithError(f"data.rows={layout} lays out samples the target wrote (data=generated, or prompt + "
                                  f"completion pairs); {source} is plain text: use data.rows=stream")
        docs = _documents(source, text_field, max_documents)
    else:
        docs = [(r, row) for r, row in enumerate(rows[:max_documents] if max_documents else rows)
                if row.get("text", "").strip() or row.get("ids")]
    if not docs:
        raise DraftsmithError(f"corpus {source} is empty")
    g = torch.Generator(device="cpu").manual_seed(seed)  # the document order: host-side, the same everywhere
    order = torch.randperm(len(docs), generator=g, device="cpu").tolist()
    n_val = max(1, int(round(len(docs) * val_fraction))) if len(docs) > 1 else 0
    splits = {"val": [docs[i] for i in order[:n_val]], "train": [docs[i] for i in order[n_val:]]}
    eos = tokenizer.eos_token_id
    out = {}
    for name, items in splits.items():
        if rows is None:
            ids = tokenizer(items, add_special_tokens=False)["input_ids"] if items else []
            src = None
        else:
            ids, src = zip(*(_sampled_tokens(tokenizer, row, r) for r, row in items)) if items else ((), ())
            if layout != "stream" and name == "train":
                out.update(_sample_rows(ids, src, block_size, eos, 1 if layout == "sample" else None))
                continue
        flat = torch.tensor([t for doc in ids for t in (*doc, eos)], dtype=torch.long)
        n = len(flat) // block_size
        out[name] = flat[: n * block_size].view(n, block_size)
        if src is not None and name == "train":
            out["train_src"] = torch.tensor([s for doc in src for s in doc], dtype=torch.long)[: n * block_size].view(
                n, block_size)
    if len(out["train"]) < min_train_blocks or len(out["val"]) < min_val_blocks:
        total = sum(len(out[k]) * block_size for k in ("train", "val"))
        raise DraftsmithError(f"corpus {source} is too small: {total} tokens make {len(out['train'])} train and "
                              f"{len(out['val'])} val blocks of {block_size}; need {min_train_blocks} and "
                              f"{min_val_blocks} (lower data.block_size or add text)")
    need = sum(t.numel() * t.element_size() for t in out.values())
    with disk_full("the tokenized blocks", path, need=need, then="free space there or point DRAFTSMITH_HOME at a "
                   "larger disk, and rerun (the corpus is tokenized again; nothing else was written)"), \
            atomic_path(path) as tmp:  # a torn file is removed, never left under the cache's name
        save_file(out, tmp)
    return out


def _complete_rows(path: Path, batch_size: int, total: int) -> int:
    """Rows of a resumable JSONL that a killed run left whole, rounded down to whole batches (so the resumed run
    draws the same batches with the same seeds as an uninterrupted one would); what follows them is cut off: a row
    torn mid-write is never read as data."""
    if not path.exists():
        return 0
    lines = path.read_bytes().split(b"\n")[:-1]  # what follows the last newline is torn
    whole = 0
    for line in lines:
        try:
            json.loads(line)
        except ValueError:
            break
        whole += 1
    keep = whole if whole >= total else whole - whole % batch_size
    with path.open("r+b") as f:
        f.truncate(sum(len(line) + 1 for line in lines[:keep]))
    return keep


def generate_corpus(target, tokenizer, prompts: list[str], out_path: str | Path, *, samples_per_prompt: int = 1,
                    max_new_tokens: int = 256, temperature: float = 0.8, top_p: float = 0.95, batch_size: int = 16,
                    seed: int = 0, progress: bool = True, max_seconds: float | None = None,
                    keep_logits: int = 0, keep_features: list[int] | None = None, engine: str = "draftsmith",
                    target_name: str | None = None, check=None, tensor_parallel_size: int = 1,
                    data_parallel_size: int = 1, gpu_memory_utilization: float = 0.5, dtype: torch.dtype | None = None,
                    completions: list[str] | None = None) -> Path:
    """Sample continuations of `prompts` from the target into a JSONL file (fields `text`; `ids`, the prompt's and
    the sample's tokens as decoded; `prompt_tokens`; `eos`, whether the sample ended with EOS); resumable: rows
    already in the file are kept and the work continues after them. With `max_seconds`, sampling stops after the
    batch that crosses it (samples_per_prompt is then a ceiling: a fast CPU gets more data in the same time), and
    a later call continues the file. With `keep_logits` = k, the target's top-k log-probabilities at every sampled
    token are kept beside the file (`logits_dir`), so training needs no teacher pass over these samples; with
    `keep_features` (a feature draft's target layers) also the hidden states entering them at every position the
    target ran on (the prompt's and each sampled token's but the last): all a feature draft reads (EAGLE's offline
    mode, at no extra target pass). `engine` (data/generation.py): `draftsmith` samples with our loop in this
    process, `vllm` in vLLM (`target_name` is what it loads, in `dtype`, the target's; `target` may then be None: it
    is not needed to sample, and on a GPU loads after vLLM's start; `check`, an `EngineCheck`, judges it first;
    features are not kept: a feature draft's teacher pass computes them in training). With `completions` (one per
    prompt, sampled elsewhere) nothing is sampled: one teacher pass keeps what the loop would have kept for them."""
    from tqdm import tqdm

    from draftsmith.data.generation import own_batches, teacher_batches
    from draftsmith.engines import vllm
    from draftsmith.sampling.prompts import pad_id, prompt_rows

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    # sample-major: raising samples_per_prompt later extends the cached file instead of re-ordering it
    jobs = [(i, p) for _ in range(samples_per_prompt) for i, p in enumerate(prompts)]
    done = _complete_rows(out_path, batch_size, len(jobs))
    todo = jobs[done:]
    rows = prompt_rows(tokenizer, [p for _, p in todo]) if todo else []
    sampling = dict(seed=seed, first_row=done, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                    eos=tokenizer.eos_token_id, keep_logits=keep_logits)
    if not rows:  # a generator: `closing` needs its close()
        batches = (b for b in ())
    elif completions is not None:
        done_c = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in completions[done:]]
        batches = teacher_batches(target, rows, done_c, batch_size, pad=pad_id(tokenizer), keep_features=keep_features,
                                  **sampling)
        engine = "teacher pass"
    elif engine == "vllm":
        batches = vllm.batches(target_name or target.config.name_or_path, dtype or target.dtype, rows, batch_size,
                               check=check, tensor_parallel_size=tensor_parallel_size,
                               data_parallel_size=data_parallel_size, gpu_memory_utilization=gpu_memory_utilization,
                               **sampling)
    else:
        batches = own_batches(target, rows, batch_size, pad=pad_id(tokenizer), keep_features=keep_features,
                              **sampling)
    if keep_logits and progress and todo:
        print(store_estimate(len(jobs), max_new_tokens, keep_logits, 3 * target.config.hidden_size
                             if keep_features and engine != "vllm"
                             else 0, max(len(r) for r in rows), where=out_path.parent), flush=True)
    new_tokens, t0, written = 0, time.perf_counter(), [done]

    def left() -> float:  # the rest of this corpus: rows as large as those written, and their kept logits
        rows_left = len(jobs) - written[0]
        row = out_path.stat().st_size / written[0] if written[0] and out_path.exists() else 8 * (max_new_tokens + 64)
        return rows_left * (row + (max_new_tokens * keep_logits * (2 + 4) if keep_logits else 0))

    full = disk_full(f"the target's samples ({engine})", out_path, need=left, then=lambda: (
        f"free space or point DRAFTSMITH_HOME at a larger disk, and rerun: the {written[0]} samples written are "
        "kept and sampling continues after them"))
    # with a time box the bar runs over the box's seconds (its ETA is the box's end, not that of the ceiling of
    # samples, which a box is not meant to reach); the samples go in the postfix
    boxed = max_seconds is not None
    bar_kw = (dict(total=round(max_seconds), unit="s", bar_format="{desc}: {percentage:3.0f}%|{bar}| "
                   "{elapsed} of the {total}s time box{postfix}") if boxed else dict(total=len(jobs), initial=done))
    with full, out_path.open("a") as f, tqdm(desc=f"target-generated corpus ({engine})", disable=not progress,
                                             **bar_kw) as bar, closing(batches):
        for start, prompt_ids, tokens, record, _ in batches:
            if record is not None:  # before the rows: a row in the file always has its logits, a torn batch is redone
                _write_logits(out_path, done + start, record)
            for (_, prompt), p_ids, toks in zip(todo[start:], prompt_ids, tokens):
                eos = bool(toks) and toks[-1] == tokenizer.eos_token_id
                f.write(json.dumps({"text": prompt + tokenizer.decode(toks, skip_special_tokens=True),
                                    "ids": p_ids + toks[: len(toks) - eos], "prompt_tokens": len(p_ids),
                                    "eos": eos}) + "\n")
            f.flush()
            new_tokens += sum(len(t) for t in tokens)
            elapsed = time.perf_counter() - t0
            n = written[0] = done + start + len(tokens)
            bar.set_postfix_str(f"{n}/{len(jobs)} samples, {new_tokens / elapsed:.0f} tokens/s, batch {len(tokens)}",
                                refresh=False)
            bar.update(min(round(elapsed), bar.total) - bar.n if boxed else len(tokens))
            if max_seconds is not None and time.perf_counter() - t0 > max_seconds and start + batch_size < len(todo):
                bar.write(f"target-generated corpus: {max_seconds / 60:.2g} min spent (data.generated.max_minutes), "
                          f"stopping at {n} of {len(jobs)} samples, {n / len(prompts):.1f} per prompt; a rerun "
                          "continues the cached file")
                break
    return out_path


def keep_label_logits(target, rows: list[dict], out_path: str | Path, *, keep_logits: int, batch_size: int = 8,
                      pad: int = 0, progress: bool = True) -> Path:
    """The target's top-k logits at given positions of token rows it did not sample (data=chat: each training
    sample's assistant labels), in the store `generate_corpus` keeps: a JSONL of rows ({"ids", "at": the label
    positions kept}) and beside it one file of logits per batch (`logits_dir`, read back by `sampled_logits`).
    One teacher pass, resumable after its last whole batch (logits written before their rows), a full disk said in
    one line with what was written kept."""
    from tqdm import tqdm

    from draftsmith.data.generation import label_batches

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done = _complete_rows(out_path, batch_size, len(rows))
    todo = rows[done:]
    if progress and todo:
        per_row = max(len(r["at"]) for r in rows)
        print(store_estimate(len(rows), per_row, keep_logits, where=out_path.parent), flush=True)
    written = [done]
    full = disk_full("the target's kept logits (teacher pass)", out_path,
                     need=lambda: sum(len(r["at"]) for r in rows[written[0]:]) * keep_logits * (2 + 4),
                     then=lambda: (f"free space or point DRAFTSMITH_HOME at a larger disk, and rerun: the {written[0]} "
                                   "samples done are kept and the pass continues after them"))
    batches = label_batches(target, [r["ids"] for r in todo], [r["at"] for r in todo], batch_size,
                            keep_logits=keep_logits, pad=pad) if todo else (b for b in ())
    with full, out_path.open("a") as f, tqdm(total=len(rows), initial=done, disable=not progress,
                                             desc="the target's logits kept (teacher pass)") as bar, closing(batches):
        for start, record, _ in batches:
            _write_logits(out_path, done + start, record)  # before the rows: a row in the file has its logits
            chunk = todo[start: start + batch_size]
            for r in chunk:
                f.write(json.dumps({"ids": r["ids"], "at": r["at"]}) + "\n")
            f.flush()
            written[0] = done + start + len(chunk)
            bar.update(len(chunk))
    return out_path


def store_estimate(samples: int, new_tokens: int, k: int, features: int = 0, prompt_tokens: int = 0,
                   where: Path | None = None) -> str:
    """One line: what the kept store of `samples` will hold at most (fp16 log-probabilities and int32 ids per sampled
    token; fp16 features per position the target ran on), so a 1M-sample corpus of an 8B target is no surprise."""
    per_sample = new_tokens * k * (2 + 4) + (new_tokens + prompt_tokens) * features * 2
    total = samples * per_sample
    what = f"top-{k} logits" + (f" and {features} feature values a position" if features else "")
    return (f"draftsmith: the kept store ({what}) takes up to {total / 2**30:.3g} GiB for {samples} samples of "
            f"{new_tokens} tokens ({per_sample / 2**20:.3g} MiB a sample), beside the corpus in "
            f"{where or cache_home()}")


def logits_dir(path: Path) -> Path:
    """Where `generate_corpus` keeps the target's logits of a sample file: one safetensors file per batch."""
    return path.with_name(path.name + ".logits")


def _write_logits(path: Path, first_row: int, record: dict) -> None:
    """A batch's kept logits (data/generation.py: `values`, `index` row-major, `steps` per row, `tokens`, so a reader
    can check that a file of logits belongs to the rows the JSONL holds now; with features also `features`,
    `positions`, `layers`) as one file beside the sample file, written atomically."""
    with atomic_path(logits_dir(path) / f"{first_row:09d}.safetensors") as tmp:
        save_file(record, tmp)


@dataclass
class Kept:
    """Where `generate_corpus` kept the logits of a sample file: row r's step t is entry `start[r] + t` (its top-k
    log-probabilities and their token ids), and with features, its position p is feature entry
    `feature_start[r] + p`; -1 for a row without them (sampled without keeping them, another feature layer choice,
    or a file of logits that does not match the row's tokens). Entries are numbered across the batch files in order
    and read on demand (`take`): nothing is held but this index."""

    files: list[Path]
    offsets: torch.Tensor  # (files + 1,) first entry of each file, then the total
    feature_offsets: torch.Tensor | None
    start: torch.Tensor
    feature_start: torch.Tensor | None = None

    def take(self, at: torch.Tensor, names: tuple[str, ...], features: bool = False) -> list[torch.Tensor]:
        """The entries `at` (1-D, each >= 0) of the named tensors, in the order of `at`; each file is opened once
        and only the span of it that is needed is read."""
        offsets = self.feature_offsets if features else self.offsets
        need, where = torch.unique(at, return_inverse=True)
        parts: list[list[torch.Tensor]] = [[] for _ in names]
        fid = torch.searchsorted(offsets, need, right=True) - 1
        for f in fid.unique().tolist():
            sel = need[fid == f] - offsets[f]
            lo, hi = int(sel.min()), int(sel.max()) + 1
            with safe_open(str(self.files[f]), "pt") as fh:
                for out, name in zip(parts, names):
                    out.append(fh.get_slice(name)[lo:hi][sel - lo])
        return [torch.cat(p)[where] for p in parts]


def sampled_logits(path: Path, rows: list[dict], layers: list[int] | None = None) -> Kept | None:
    """The index of the target's logits kept beside sample file `path` (and, with `layers`, of its features at
    those layers); None when there are none. Reads each file's small tensors (steps, tokens), never its logits."""
    files = sorted(logits_dir(path).glob("*.safetensors"))
    if not files:
        return None
    start = torch.full((len(rows) + 1,), -1, dtype=torch.long)
    fstart = start.clone()
    used, offsets, foffsets, offset, foffset, any_features = [], [0], [0], 0, 0, False
    for f in files:
        with safe_open(str(f), "pt") as fh:
            first, steps = int(f.stem), fh.get_tensor("steps")
            if first + len(steps) > len(rows):
                continue  # rows the JSONL no longer holds (a run cut short, then continued with another batch size)
            keys = set(fh.keys())
            has_features = (layers is not None and "features" in keys
                            and fh.get_tensor("layers").tolist() == list(layers))
            tokens = fh.get_tensor("tokens")
            n_values = fh.get_slice("values").get_shape()[0]
            positions = fh.get_tensor("positions") if has_features else None
            n_features = fh.get_slice("features").get_shape()[0] if has_features else 0
        at = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), steps]), 0)
        fat = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), positions]), 0) if has_features else 0
        for j, n in enumerate(steps.tolist()):
            row = rows[first + j]
            if "ids" not in row:
                continue
            chat = "at" in row  # `keep_label_logits`' row: its kept steps are the labels at positions `at`
            want = [row["ids"][p + 1] for p in row["at"]] if chat else row["ids"][row["prompt_tokens"]:]
            toks = tokens[at[j]: at[j] + n].tolist()
            if toks[: len(want)] == want and len(toks) - len(want) == (0 if chat else int(row["eos"])):
                start[first + j] = offset + at[j]
                if has_features and not chat and positions[j] == row["prompt_tokens"] - 1 + n:
                    fstart[first + j] = foffset + fat[j]
        used.append(f)
        offset += n_values
        foffset += n_features
        any_features |= has_features
        offsets.append(offset)
        foffsets.append(foffset)
    return Kept(used, torch.tensor(offsets), torch.tensor(foffsets) if any_features else None, start,
                fstart if any_features else None)


def prefill_teacher(cache, src: torch.Tensor, path: Path, rows: list[dict], layers: list[int] | None = None,
                    chunk_bytes: int = 256 << 20, min_known: float = 0.5,
                    positions: torch.Tensor | None = None) -> int:
    """Fill `cache` (data/teacher.py) with what the target kept as it sampled the corpus `path` at the positions
    `src` points at (`load_blocks`' train_src): its logits where it sampled a token, and with `layers` its features
    wherever it ran. Blocks go through in chunks of about `chunk_bytes` of the cache's records, each reading only
    the entries it points at, so memory stays flat however large the corpus. A block with fewer than `min_known` of
    its positions kept is left to the teacher pass (0: every block trains on what was kept, as a rank that holds no
    target must). With `positions` (data.rows=sample|packed: `load_blocks`' train_pos) the share is taken over a
    row's label positions inside its samples: padding needs no teacher. Returns the number of blocks filled."""
    kept = sampled_logits(path, rows, layers)
    if kept is None or (layers is not None and kept.feature_start is None):
        return 0
    ok = src >= 0
    row, pos = torch.where(ok, src >> _POS_BITS, len(rows)), src & ((1 << _POS_BITS) - 1)
    prompt = torch.tensor([r.get("prompt_tokens", 0) for r in rows] + [0])[row]
    steps = torch.tensor([len(r["ids"]) - r["prompt_tokens"] + int(r["eos"]) if "ids" in r else 0 for r in rows]
                         + [0])[row]
    step = pos - (prompt - 1)  # the token at position p was fed at step p - (P - 1) and its logits drawn then
    base = kept.start[row]
    at = torch.where(ok & (base >= 0) & (step >= 0) & (step < steps), base + step, -1)
    fat = None
    if layers is not None:
        fbase = kept.feature_start[row]
        fat = torch.where(ok & (fbase >= 0) & (step < steps), fbase + pos, -1)
    if positions is not None and min_known > 0:  # the share over in-sample labels; cache.prefill then takes any
        P = cache.positions
        inside = positions[:, 1: P + 1] >= 1
        share = (at[:, :P] >= 0).sum(1) / inside.sum(1).clamp_min(1)
        at = torch.where((share >= min_known)[:, None], at, -1)
        min_known = 1e-9
    filled, per = 0, max(1, chunk_bytes // cache.record)
    for lo in range(0, len(src), per):
        blocks = torch.arange(lo, min(lo + per, len(src)))
        a = at[blocks, : cache.positions]
        have = a >= 0
        if not have.any() and min_known > 0:
            continue
        values, index = kept.take(a[have], ("values", "index"))
        local = torch.full_like(a, -1)
        local[have] = torch.arange(int(have.sum()))
        extra = {}
        if fat is not None:
            fa = fat[blocks, : cache.positions]
            fhave = fa >= 0
            flocal = torch.full_like(fa, -1)
            flocal[fhave] = torch.arange(int(fhave.sum()))
            feats = (kept.take(fa[fhave], ("features",), features=True)[0] if fhave.any()
                     else torch.zeros(0, cache.n_features, dtype=torch.float16))
            extra = {"feature_at": flocal, "features": feats}
        filled += cache.prefill(local, values, index, rows=blocks, min_known=min_known, **extra)
    return filled


def prefill_labels(cache, path: Path, rows: list[dict], samples: list[list[int]], chunk_bytes: int = 256 << 20) -> int:
    """Fill `cache` (one block a sample, data/teacher.py) from `keep_label_logits`' store at `path`: sample i takes
    row i's kept logits at its positions `at` (the rest of it is known to have none: no loss is taken there); a
    sample whose row is missing or holds other tokens is left to the teacher pass. In chunks of about `chunk_bytes`
    of the cache's records. Returns the samples filled."""
    kept = sampled_logits(path, rows)
    if kept is None:
        return 0
    filled, per = 0, max(1, chunk_bytes // cache.record)
    for lo in range(0, len(samples), per):
        block = torch.arange(lo, min(lo + per, len(samples)))
        src = torch.full((len(block), cache.positions), -1, dtype=torch.long)
        for j, i in enumerate(block.tolist()):
            if i < len(rows) and kept.start[i] >= 0 and rows[i]["ids"] == samples[i]:
                at = torch.tensor(rows[i]["at"], dtype=torch.long)
                src[j, at] = int(kept.start[i]) + torch.arange(len(at))  # each label's entry, in order
        have = src >= 0
        if not have.any():
            continue
        values, index = kept.take(src[have], ("values", "index"))
        local = torch.full_like(src, -1)
        local[have] = torch.arange(int(have.sum()))
        # every sample with a kept label fills (its other positions carry no loss), none without: those go to the
        # teacher pass, and a rank without the target is refused them up front (train/draft.py)
        filled += cache.prefill(local, values, index, rows=block, min_known=1e-9)
    return filled


def sampled_token_counts(blocks: dict, rows: list[dict], vocab: int) -> torch.Tensor:
    """(vocab,) counts of the tokens the target itself sampled in the training blocks: the positions the loss is
    taken on, never a prompt's tokens, the EOS seam or padding (draft.vocab_count=sampled). speculators counts its
    pruned head's tokens so ("Only count tokens where loss_mask is 1", train/vocab_mapping.py), as does SpecForge:
    a head chosen over prompts spends rows on tokens the sampler never proposes. Counts every block token where the
    blocks carry no pointers to the target's samples (a plain text corpus)."""
    src = blocks.get("train_src")
    if src is None:
        return torch.bincount(blocks["train"].flatten(), minlength=vocab)
    ok = src >= 0
    row = torch.where(ok, src >> _POS_BITS, 0)
    prompt = torch.tensor([r.get("prompt_tokens", 0) for r in rows] or [0])[row]
    own = ok & ((src & ((1 << _POS_BITS) - 1)) >= prompt)
    return torch.bincount(blocks["train"][own], minlength=vocab)
