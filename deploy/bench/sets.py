"""The evaluation sets `draftsmith bench serve` runs, each a list of conversations (role/content messages) that the
target's chat template turns into prompts. Named for what they are, and never trained on (tests/test_sets.py):

- `code`: the shipped code evaluation prompts (recipes/prompts/code.jsonl), each asked as "complete this code";
- `math`: short arithmetic word problems written for draftsmith (recipes/prompts/math.jsonl), not GSM8K; or a file
  the user names (`--prompts my_math.jsonl`: one JSON object a line with a `prompt` or a `messages` list);
- `chat`: the benchmark half of the held-out ShareGPT conversations (`draftsmith.data.conversations.
  heldout_chat_set`: held out by conversation, never trained on, never the data=chat validation that picks a
  checkpoint) that have a second user turn, measured over two turns: turn 1 is the first user message; turn 2 is
  turn 1, the engine's OWN turn-1 answer (not the dataset's), then the conversation's next user message
  (`second_turns`, `turn_two`), as a served chat goes on. A `messages` .jsonl file with second user turns gets
  turn 2 the same way.

HumanEval, GSM8K, MT-Bench and XSum are not shipped (no registry package ships them; HumanEval and XSum are kept
for independent checks).
"""

from __future__ import annotations

import json
from pathlib import Path

from draftsmith.sampling.errors import DraftsmithError
from draftsmith.sampling.prompts import PROMPTS_DIR, load_prompts

SETS = ("chat", "code", "math")
# the instruction a code opening is asked with: the chat template wants a request, not a bare opening
CODE_ASK = "Complete this Python code:\n\n"


def load_set(name_or_path: str, n: int) -> list[list[dict]]:
    """The first `n` conversations of a named set, or of a JSONL file (`prompt` or `messages` per line)."""
    if n < 1:
        raise DraftsmithError(f"--n-prompts must be at least 1, got {n}")
    if name_or_path == "chat":
        return chat_set(n)
    if name_or_path == "code":
        return [[{"role": "user", "content": CODE_ASK + r["prompt"]}] for r in load_prompts("code", n)]
    if name_or_path == "math":
        return [[{"role": "user", "content": r["prompt"]}] for r in load_prompts("math", n)]
    path = Path(name_or_path)
    if not path.is_file():
        raise DraftsmithError(f"no prompt set {name_or_path!r}: name one of {', '.join(SETS)} or a .jsonl file")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if rows and all(isinstance(r.get("messages"), list) for r in rows):
        return [first_turn(r["messages"]) for r in rows[:n]]
    return [[{"role": "user", "content": r["prompt"]}] for r in load_prompts(str(path), n)]


def second_turns(name_or_path: str, n: int) -> list[dict | None] | None:
    """The next user message after the first answer of each of `load_set`'s conversations (None for one that has
    none), or None for a set of single requests (code, math, a `prompt` file)."""
    if name_or_path == "chat":
        convs = _chat(n)
    elif name_or_path in SETS or not Path(name_or_path).is_file():
        return None
    else:
        rows = [json.loads(line) for line in Path(name_or_path).read_text(encoding="utf-8").splitlines()
                if line.strip()]
        if not (rows and all(isinstance(r.get("messages"), list) for r in rows)):
            return None
        convs = [r["messages"] for r in rows[:n]]
    nxt = [_next_user(c) for c in convs]
    return nxt if any(nxt) else None


def turn_two(first: list[dict], answer: str, next_user: dict) -> list[dict]:
    """Turn 2 of a conversation: turn 1 as asked, the engine's own answer to it, then the next user message."""
    return [*(dict(m) for m in first), {"role": "assistant", "content": answer}, dict(next_user)]


def _next_user(messages: list[dict]) -> dict | None:
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    return dict(messages[users[1]]) if len(users) > 1 else None


def first_turn(messages: list[dict]) -> list[dict]:
    """The conversation up to and including its first user message (a system message before it kept)."""
    for i, m in enumerate(messages):
        if m.get("role") == "user":
            return [dict(x) for x in messages[: i + 1]]
    raise DraftsmithError("a conversation of the set has no user message")


def chat_set(n: int) -> list[list[dict]]:
    """The first turns of the benchmark ShareGPT conversations that go on to a second user turn (data/
    conversations.py: the half of the held-out split that neither training nor validation reads)."""
    return [first_turn(c) for c in _chat(n)]


def _chat(n: int) -> list[list[dict]]:
    """The first `n` held-out conversations with two user turns or more (imported here, where it is used, so that
    the code and math sets need no ShareGPT download)."""
    from draftsmith.data.conversations import heldout_chat_set

    return heldout_chat_set(n, user_turns=2)


def training_sources() -> dict[str, list[str]]:
    """Every shipped prompt file that training reads (the data recipes' prompt files), by file name."""
    return {p.name: [r["prompt"] for r in load_prompts(str(p))] for p in sorted(PROMPTS_DIR.glob("*.jsonl"))
            if p.stem in ("train", "broad")}
