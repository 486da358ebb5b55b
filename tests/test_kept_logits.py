"""The target's logits kept as it samples the training corpus: each is the distribution its token was drawn from,
stored at the position it belongs to, and training on them needs no teacher pass where they exist."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_llama

from draftsmith.data.corpus import (
    _POS_BITS,
    generate_corpus,
    load_blocks,
    prefill_teacher,
    sampled_logits,
    sampled_rows,
)
from draftsmith.data.teacher import TeacherCache
from draftsmith.sampling import autoregressive_generate

PROMPTS = ["def a():", "import os", "class B:", "x = 1", "for i in range(3):", "# hello"]


@pytest.fixture(scope="module")
def tiny():
    from draftsmith.sampling.load import load_model, load_tokenizer

    return load_tokenizer("tiny-random"), load_model("tiny-random", "fp32")


def test_on_logits_sees_the_logits_each_token_is_drawn_from():
    """Left-padded batch, rows ending at different steps: each row gets one call per token it emits, with the
    logits a teacher-forced pass over its own prompt and tokens gives at that position."""
    target = tiny_llama(vocab=32, layers=2, hidden=32, seed=0, logit_scale=3.0)
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10], [0, 3, 4, 5]])
    mask = (torch.arange(4) >= torch.tensor([[2], [0], [1]])).long()
    seen = {0: [], 1: [], 2: []}

    def on_logits(rows, logits):
        for r, lg in zip(rows.tolist(), logits):
            seen[r].append(lg.clone())

    kw = dict(attention_mask=mask, max_new_tokens=6, temperature=1.0)
    first = autoregressive_generate(target, ids, **kw, generator=torch.Generator().manual_seed(3))
    eos = int(first.tokens[1][2])  # row 1 ends at its third token (or before): rows leave the batch at different steps
    gen = autoregressive_generate(target, ids, **kw, eos_token_id=eos, generator=torch.Generator().manual_seed(3),
                                  on_logits=on_logits)
    assert min(len(t) for t in gen.tokens) <= 3 < max(len(t) for t in gen.tokens)
    for r, toks in enumerate(gen.tokens):
        assert len(seen[r]) == len(toks) > 0
        full = torch.cat([ids[r][mask[r].bool()], toks])[None]
        with torch.no_grad():
            direct = target(input_ids=full).logits[0]
        P = int(mask[r].sum())
        torch.testing.assert_close(torch.stack(seen[r]), direct[P - 1: P - 1 + len(toks)], atol=1e-4, rtol=1e-4)


def test_kept_logits_land_where_their_token_is_the_label(tmp_path, tiny):
    """generate_corpus(keep_logits) -> load_blocks -> prefill: at every position the cache calls known, the block's
    next token is the token sampled from those logits, and the kept values are the top-k of a teacher pass over
    that sample alone; prompt positions and the seams between samples are unknown, and the rest are known."""
    tok, target = tiny
    path = tmp_path / "g.jsonl"
    generate_corpus(target, tok, PROMPTS, path, samples_per_prompt=3, max_new_tokens=24, batch_size=4,
                    progress=False, keep_logits=8)
    rows = sampled_rows(str(path))
    assert len(rows) == 18 and all(r["ids"][: r["prompt_tokens"]] for r in rows)
    blocks = load_blocks(str(path), tok, 16, val_fraction=0.1)
    V = target.config.vocab_size
    cache = TeacherCache(len(blocks["train"]), 15, 8, V)
    assert prefill_teacher(cache, blocks["train_src"], path, rows) == int(cache.filled.sum()) > 0

    direct = {}
    for r, row in enumerate(rows):
        with torch.no_grad():
            lp = torch.log_softmax(target(input_ids=torch.tensor([row["ids"]])).logits[0].float(), -1)
        direct[r] = (lp, row["prompt_tokens"])
    src = blocks["train_src"][:, :15]
    known = cache.known
    assert bool(known.any()) and not bool(known.all())
    eos = tok.eos_token_id
    checked = 0
    for b, t in known.nonzero().tolist():
        r, p = int(src[b, t]) >> _POS_BITS, int(src[b, t]) & ((1 << _POS_BITS) - 1)
        ids = rows[r]["ids"]
        lp, P = direct[r]
        assert p >= P - 1  # the prompt's own tokens were never drawn
        label = int(blocks["train"][b, t + 1])
        assert label == (ids[p + 1] if p + 1 < len(ids) else eos)
        top, idx = lp[p].topk(8)
        torch.testing.assert_close(cache.read(torch.tensor([b]))["values"][0, t].float(), top, atol=4e-3, rtol=0)
        checked += 1
    assert checked > 100
    # unknown where the target sampled nothing: a prompt's own tokens, the seam after a sample, the last token of
    # a sample cut at max_new_tokens (never fed back)
    for b, t in (~known & cache.filled[:, None]).nonzero().tolist():
        r, p = int(src[b, t]) >> _POS_BITS, int(src[b, t]) & ((1 << _POS_BITS) - 1)
        row = rows[r] if src[b, t] >= 0 else None
        assert row is None or p < row["prompt_tokens"] - 1 or (p == len(row["ids"]) - 1 and not row["eos"])


def test_kept_logits_are_ignored_for_rows_they_do_not_match(tmp_path, tiny):
    """A row sampled without keep_logits, and a row whose tokens differ from its file's (a file cut short and
    continued differently), get no kept logits: their positions go to the teacher pass."""
    tok, target = tiny
    path = tmp_path / "g.jsonl"
    kw = dict(max_new_tokens=12, batch_size=2, progress=False)
    generate_corpus(target, tok, PROMPTS[:2], path, **kw)  # no logits kept
    generate_corpus(target, tok, PROMPTS[:4], path, keep_logits=4, **kw)
    lines = path.read_text().splitlines()
    row = json.loads(lines[3])
    row["ids"][-1] = (row["ids"][-1] + 1) % tok.vocab_size
    lines[3] = json.dumps(row)
    old = json.loads(lines[0])
    lines[0] = json.dumps({"text": old["text"]})  # a row from before `ids`: tokenized from its text
    path.write_text("\n".join(lines) + "\n")
    rows = sampled_rows(str(path))
    start = sampled_logits(path, rows).start
    assert start[:4].tolist()[:2] == [-1, -1] and start[2] >= 0 and start[3] == -1
    blocks = load_blocks(str(path), tok, 8, val_fraction=0.25, min_train_blocks=1, min_val_blocks=1)
    cache = TeacherCache(len(blocks["train"]), 7, 4, target.config.vocab_size)
    prefill_teacher(cache, blocks["train_src"], path, rows)
    pointed = blocks["train_src"][:, :7][cache.known & cache.filled[:, None]] >> _POS_BITS
    assert set(pointed.tolist()) == {2}  # only the row whose logits match


def test_positions_without_a_teacher_carry_no_loss():
    """A kept block's unknown positions: the teacher stands in as the draft itself (every divergence 0) and the
    label is ignored; the known ones keep the cache's logits."""
    from draftsmith.drafts.batch import Batch
    from draftsmith.drafts.build import DraftConfig, build_draft
    from draftsmith.train.module import DraftModule

    target = tiny_llama(vocab=32, layers=2, hidden=32, seed=0, logit_scale=3.0)
    draft = build_draft(target, DraftConfig(layers=1, width_ratio=1.0, init="target"))
    blocks = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = torch.log_softmax(Batch(blocks).logits(target).float(), -1)
    top, idx = full.topk(31, -1)
    cache = TeacherCache(2, 11, 31, 32)
    src = torch.arange(22).view(2, 11)
    src[0, :3] = -1
    assert cache.prefill(src, top.reshape(22, 31).half(), idx.reshape(22, 31).int()) == 2
    loss = {"distill": True, "temperature": 1.0, "weights": {"tv": 1}, "compile": False}
    module = DraftModule(draft, target, loss=loss, optim={"lr": 1e-2}, sampler={"temperature": 1.0}, max_steps=1,
                         teacher_cache=cache)
    logits, tlogits, labels, _ = module.objective.train_outputs(module, Batch(blocks), torch.tensor([0, 1]))
    unknown = torch.zeros(22, dtype=torch.bool)
    unknown[:3] = True
    torch.testing.assert_close(tlogits[unknown], logits[unknown].detach())
    assert (labels[unknown] == -100).all() and (labels[~unknown] >= 0).all()
    torch.testing.assert_close(torch.log_softmax(tlogits[~unknown], -1), full.reshape(22, 32)[~unknown],
                               atol=2e-2, rtol=0)


LAYERS = [0, 2, 3]


@pytest.fixture(scope="module")
def kept_features(tmp_path_factory, tiny):
    tok, target = tiny
    path = tmp_path_factory.mktemp("kept") / "g.jsonl"
    generate_corpus(target, tok, PROMPTS, path, samples_per_prompt=4, max_new_tokens=24, batch_size=4, progress=False,
                    keep_logits=8, keep_features=LAYERS)
    rows = sampled_rows(str(path))
    blocks = load_blocks(str(path), tok, 16, val_fraction=0.2)
    cache = TeacherCache(len(blocks["train"]), 15, 8, target.config.vocab_size, features=3 * target.config.hidden_size)
    assert prefill_teacher(cache, blocks["train_src"], path, rows, LAYERS) == int(cache.filled.sum()) > 0
    return path, rows, blocks, cache


def test_kept_features_are_the_targets_hidden_states_at_each_position(tiny, kept_features):
    """generate_corpus(keep_features) keeps, at every position the target ran on (the prompt's and each sampled
    token's), the hidden states a teacher-forced pass over that sample alone gives there; only the seams and the last
    token of a capped sample (never fed back) have none, and every position with a kept teacher has its feature."""
    from draftsmith.sampling.feature import FeatureTap

    tok, target = tiny
    path, rows, blocks, cache = kept_features
    direct = {}
    for r, row in enumerate(rows):
        with torch.no_grad(), FeatureTap(target, LAYERS) as tap:
            target(input_ids=torch.tensor([row["ids"]]))
            direct[r] = tap.take()[0]
    src, kf = blocks["train_src"][:, :15], cache.known_features
    checked = 0
    for b, t in kf.nonzero().tolist():
        r, p = int(src[b, t]) >> _POS_BITS, int(src[b, t]) & ((1 << _POS_BITS) - 1)
        torch.testing.assert_close(cache.read(torch.tensor([b]))["features"][0, t].float(), direct[r][p], atol=1e-2,
                                   rtol=1e-2)
        checked += 1
    assert checked > 200 and bool((kf | ~cache.filled[:, None]).float().mean() > 0.8)
    assert not bool((cache.known & ~kf).any())
    for b, t in (~kf & cache.filled[:, None]).nonzero().tolist():
        row = rows[int(src[b, t]) >> _POS_BITS] if src[b, t] >= 0 else None
        assert row is None or (int(src[b, t]) & ((1 << _POS_BITS) - 1) == len(row["ids"]) - 1 and not row["eos"])
    # other layers than the file kept: no features, so a feature draft's cache takes nothing; the logits still serve
    # a draft that needs no features
    H3 = 3 * target.config.hidden_size
    other = TeacherCache(len(blocks["train"]), 15, 8, target.config.vocab_size, features=H3)
    assert prefill_teacher(other, blocks["train_src"], path, rows, [1, 2, 3]) == 0
    plain = TeacherCache(len(blocks["train"]), 15, 8, target.config.vocab_size)
    assert prefill_teacher(plain, blocks["train_src"], path, rows) == int(cache.filled.sum())


def test_a_feature_draft_trains_on_kept_features_without_the_target(tiny, kept_features):
    """A feature draft's step on kept blocks runs no target (it has none here); slots whose teacher or feature was
    not kept carry no loss (the draft's own logits as teacher, label ignored), and what lies at a position without
    a feature never reaches the slots that carry the loss."""
    from draftsmith.drafts.batch import Batch
    from draftsmith.drafts.feature import build_feature_draft
    from draftsmith.train.module import DraftModule

    tok, target = tiny
    path, rows, blocks, cache = kept_features
    draft = build_feature_draft(target, LAYERS)
    loss = {"distill": True, "temperature": 1.0, "weights": {"tv": 1}, "compile": False}
    module = DraftModule(draft, None, loss=loss, optim={"lr": 1e-2}, sampler={"temperature": 1.0}, max_steps=1,
                         unroll=2, teacher_cache=cache)
    sel = (cache.filled & ~cache.known_features.all(1)).nonzero().squeeze(1)[:4]
    assert len(sel) > 0  # blocks with a seam inside
    b = Batch(blocks["train"][sel])
    logits, tlogits, labels, _ = module.objective.train_outputs(module, b, sel)
    bad = labels == -100
    assert 0 < int(bad.sum()) < len(labels) // 2
    torch.testing.assert_close(tlogits[bad], logits[bad].detach())
    saved = cache.read(sel)["features"]
    planted, hole = saved.clone(), ~cache.known_features[sel]
    planted[hole] = 1e3 * torch.randn(int(hole.sum()), saved.shape[-1]).half()
    cache.write(sel, features=planted)
    again, _, labels2, _ = module.objective.train_outputs(module, b, sel)
    cache.write(sel, features=saved)
    assert torch.equal(labels2, labels)
    torch.testing.assert_close(again[~bad], logits[~bad], atol=1e-5, rtol=1e-5)
