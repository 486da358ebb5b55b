"""Issue 61's levers, each behind a switch whose default is the old behaviour: samples as rows (data.rows), Muon
and an average of the weights (optim.name, optim.ema), the pruned head counted on the target's own tokens
(draft.vocab_count) with its mass reported, and the tv term on the sampler's truncated distributions
(loss.truncate)."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import tiny_llama

from draftsmith.data.corpus import (
    _POS_BITS,
    generate_corpus,
    load_blocks,
    prefill_teacher,
    sampled_rows,
    sampled_token_counts,
)
from draftsmith.data.teacher import TeacherCache
from draftsmith.drafts.batch import Batch
from draftsmith.drafts.build import DraftConfig, build_draft
from draftsmith.sampling.errors import DraftsmithError

PROMPTS = ["def a():", "import os", "class B:", "x = 1", "for i in range(3):", "# hello"]


@pytest.fixture(scope="module")
def tiny():
    from draftsmith.sampling.load import load_model, load_tokenizer

    return load_tokenizer("tiny-random"), load_model("tiny-random", "fp32")


@pytest.fixture(scope="module")
def corpus(tiny, tmp_path_factory):
    tok, target = tiny
    path = tmp_path_factory.mktemp("levers") / "g.jsonl"
    generate_corpus(target, tok, PROMPTS, path, samples_per_prompt=4, max_new_tokens=20, batch_size=8,
                    progress=False, keep_logits=8)
    return path, sampled_rows(str(path))


def _sample_of(src: torch.Tensor) -> torch.Tensor:
    return torch.where(src >= 0, src >> _POS_BITS, -1)


@pytest.mark.parametrize("layout", ["sample", "packed"])
def test_a_sample_never_straddles_two_rows_and_its_kept_logits_are_the_rows_own(tiny, corpus, layout):
    """data.rows=sample|packed: every sample lies whole in one row from its first token (the stream cuts samples
    across blocks: checked too, so the test says what the switch changes); the target's logits kept at a position
    are what the target gives on the row as the draft sees it (its own prompt in view, no other sample: packed rows
    through their restarting positions)."""
    tok, target = tiny
    path, rows = corpus
    width = 48
    stream = load_blocks(str(path), tok, width, val_fraction=0.2, min_val_blocks=1)
    cut = [int(s) for s in _sample_of(stream["train_src"]).unique() if s >= 0
           and len({b for b in range(len(stream["train"])) if bool((_sample_of(stream["train_src"][b]) == s).any())})
           > 1]
    assert cut, "the stream layout cuts samples across blocks"

    blocks = load_blocks(str(path), tok, width, val_fraction=0.2, min_val_blocks=1, rows=layout)
    src, pos, ids = blocks["train_src"], blocks["train_pos"], blocks["train"]
    assert torch.equal(blocks["val"], stream["val"])  # the held-out split as before
    owner = {}
    for b in range(len(ids)):
        starts = (pos[b] == 0).nonzero().squeeze(1).tolist()
        assert starts and starts[0] == 0  # a row opens with a sample's first token
        if layout == "sample":
            assert len(starts) == 1
        for s in _sample_of(src[b]).unique().tolist():
            if s >= 0:
                assert s not in owner, f"sample {s} in rows {owner.get(s)} and {b}"
                owner[s] = b
                at = (_sample_of(src[b]) == s).nonzero().squeeze(1)
                r = rows[s]
                # whole, from its first token: the row holds the sample's ids in order
                assert ids[b, at].tolist() == r["ids"][: len(at)] and int(pos[b, at[0]]) == 0
    assert len(owner) == len(stream["train_src"][stream["train_src"] >= 0].__rshift__(_POS_BITS).unique())

    V = target.config.vocab_size
    cache = TeacherCache(len(ids), width - 1, 8, V)
    assert prefill_teacher(cache, src, path, rows, positions=pos) > 0.8 * len(ids)  # padding needs no teacher
    b_all = torch.arange(len(ids))
    batch = Batch(ids, position_ids=pos.clamp_min(0) if layout == "packed" else None)
    with torch.no_grad():
        direct = torch.log_softmax(batch.logits(target).float(), -1)
    known = cache.known & cache.filled[:, None]
    assert int(known.sum()) > 100
    stored = cache.read(b_all)
    for b, t in known.nonzero().tolist():
        top = direct[b, t].gather(-1, stored["index"][b, t].long())
        torch.testing.assert_close(stored["values"][b, t].float(), top, atol=4e-3, rtol=0)
    # and the stream does not have that property: a block opening mid-sample lacks the context its kept logits had
    cache = TeacherCache(len(stream["train"]), width - 1, 8, V)
    prefill_teacher(cache, stream["train_src"], path, rows, min_known=0.0)
    with torch.no_grad():
        direct = torch.log_softmax(Batch(stream["train"]).logits(target).float(), -1)
    stored, known = cache.read(torch.arange(len(stream["train"]))), cache.known & cache.filled[:, None]
    gaps = [float((stored["values"][b, t].float() - direct[b, t].gather(-1, stored["index"][b, t].long())).abs().max())
            for b, t in known.nonzero().tolist()]
    assert max(gaps) > 0.05


def test_plain_text_refuses_the_sample_layout(tiny, tmp_path):
    tok, _ = tiny
    (tmp_path / "a.txt").write_text("some text " * 200)
    with pytest.raises(DraftsmithError, match="data.rows=sample lays out samples"):
        load_blocks(str(tmp_path / "a.txt"), tok, 16, rows="sample")
    with pytest.raises(DraftsmithError, match="data.rows must be one of"):
        load_blocks(str(tmp_path / "a.txt"), tok, 16, rows="rows")


def _module(target, **kw):
    from draftsmith.train.module import DraftModule

    draft = build_draft(target, DraftConfig(layers=1, width_ratio=1.0, init="target"))
    kw.setdefault("loss", {"weights": {"tv": 1.0, "forward_kl": 1.0}, "temperature": 1.0, "compile": False})
    kw.setdefault("optim", {"lr": 1e-2})
    return DraftModule(draft, target, sampler={"temperature": 1.0, "top_p": 1.0}, max_steps=10, **kw)


def test_sample_rows_take_no_loss_on_padding_or_across_samples():
    """A label that is padding, or the first token of the next sample in a packed row, carries no loss; the
    positions inside a sample do."""
    target = tiny_llama(vocab=32, layers=2, hidden=32, seed=0, logit_scale=3.0)
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, -1], [0, 1, 2, 3, 4, 5, -1, -1]])
    ids = torch.randint(0, 32, pos.shape, generator=torch.Generator().manual_seed(0))
    m = _module(target, row_positions=pos, packed=True)
    b = m._sample_batch(ids, torch.tensor([0, 1]))
    assert b.position_ids.tolist() == pos.clamp_min(0).tolist()
    logits, tlogits, labels, _ = m.objective.train_outputs(m, b, torch.tensor([0, 1]))
    none = (labels == -100).view(2, 7)
    assert none.tolist() == [[False, False, False, True, False, False, True],
                             [False, False, False, False, False, True, True]]
    torch.testing.assert_close(tlogits[labels == -100], logits.detach()[labels == -100])  # no divergence there
    # a packed row's second sample is computed as if alone: attention restarts with the positions
    with torch.no_grad():
        alone = Batch(ids[:1, 4:7]).logits(m.draft)
        packed = b.logits(m.draft)
    torch.testing.assert_close(packed[0, 4:6], alone[0], atol=1e-5, rtol=1e-5)
    with pytest.raises(DraftsmithError, match="data.rows=sample or packed"):
        from draftsmith.train.onpolicy import OnPolicy

        _module(target, row_positions=pos, on_policy=OnPolicy(0.5, (ids, torch.ones_like(ids)), temperature=1.0))


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest(tmp_path):
    """optim.name=muon: Muon on the layers' 2-D weights, AdamW on norms (and on the embeddings when they train);
    both step, the LR schedule reaches both, and the state round-trips through a checkpoint."""
    from helpers import fit_losses

    from draftsmith.train.module import Combined, optimizer

    target = tiny_llama(vocab=32, layers=2, hidden=32, seed=0, logit_scale=3.0)
    draft = build_draft(target, DraftConfig(layers=1, width_ratio=1.0, init="target"))
    opt = optimizer(draft, {"lr": 1e-2, "name": "muon"})
    assert isinstance(opt, Combined)
    muon, adamw = opt.optimizers
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    assert all(p.ndim == 2 for g in muon.param_groups for p in g["params"])
    emb = draft.get_input_embeddings().weight
    assert any(p is emb for g in adamw.param_groups for p in g["params"])  # not Muon's: an embedding
    assert len(opt.param_groups) == 2
    with pytest.raises(DraftsmithError, match="optim.name must be one of"):
        optimizer(draft, {"lr": 1e-2, "name": "sgd"})

    m = _module(target, optim={"lr": 1e-2, "name": "muon", "warmup_steps": 2})
    before = {n: p.detach().clone() for n, p in m.draft.named_parameters()}
    blocks = torch.randint(0, 32, (8, 12), generator=torch.Generator().manual_seed(1))
    losses = fit_losses(m, blocks, tmp_path, steps=8)
    assert len(losses) == 8 and losses[-1] < losses[0]
    moved = [n for n, p in m.draft.named_parameters() if not torch.equal(p, before[n])]
    assert any("proj" in n for n in moved) and any("norm" in n for n in moved)
    opt = m.trainer.optimizers[0]
    assert all("initial_lr" in g for g in opt.param_groups)  # the LR schedule scales both optimizers' groups
    again = optimizer(m.draft, {"lr": 1e-2, "name": "muon"})
    again.load_state_dict(opt.state_dict())
    assert len(again.optimizers[0].state_dict()["state"]) == len(opt.optimizers[0].state_dict()["state"]) > 0


def test_the_average_of_the_weights_is_validated_checkpointed_and_exported(tmp_path):
    """optim.ema: the average follows the weights with its decay; validation runs on it and training goes on from
    the raw weights; every checkpoint holds it; the report loads it into the best draft; after fit the draft is it."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from draftsmith.drafts.saved import checkpoint_state, draft_from_checkpoint
    from draftsmith.train.module import WeightAverage

    target = tiny_llama(vocab=32, layers=2, hidden=32, seed=0, logit_scale=3.0)
    m = _module(target, optim={"lr": 1e-2, "ema": 0.5})
    start = {n: p.detach().clone() for n, p in m.draft.named_parameters() if p.requires_grad}
    seen = {}
    m.validation_step = lambda batch, batch_idx: seen.setdefault(m.global_step, {
        n: p.detach().clone() for n, p in m.draft.named_parameters() if p.requires_grad})
    m.log = lambda *a, **k: None
    blocks = torch.randint(0, 32, (8, 12), generator=torch.Generator().manual_seed(1))
    data = DataLoader(TensorDataset(blocks, torch.arange(8)), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", max_steps=4, logger=False, enable_progress_bar=False,
                        default_root_dir=tmp_path, val_check_interval=2, num_sanity_val_steps=0,
                        callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, save_top_k=-1)])
    trainer.fit(m, data, DataLoader(TensorDataset(blocks[:4]), batch_size=4))
    avg = {n: getattr(m.ema, WeightAverage.key(n)) for n in m.ema.names}
    for n, p in m.draft.named_parameters():  # after fit: the draft is the average
        if p.requires_grad:
            torch.testing.assert_close(p, avg[n])
            assert not torch.equal(p, start[n])
    # validation at step 2 saw the average then, not the raw weights: the decay warms up as (1+s)/(10+s), so after
    # two steps it is far from the raw weights
    ckpts = sorted(tmp_path.glob("*.ckpt"))
    state = checkpoint_state(ckpts[0])
    assert any(k.startswith("ema.") for k in state)
    at2 = {n: state[f"ema.{WeightAverage.key(n)}"] for n in m.ema.names}
    raw2 = {n: state[f"draft.{n}"] for n in m.ema.names}
    for n in m.ema.names:
        torch.testing.assert_close(seen[2][n], at2[n])
    assert any(not torch.equal(at2[n], raw2[n]) for n in m.ema.names)
    best = draft_from_checkpoint(m.draft, ckpts[0])
    assert WeightAverage.load_into(best, state)
    for n, p in best.named_parameters():
        if n in at2:
            torch.testing.assert_close(p, at2[n])
    with pytest.raises(DraftsmithError, match="optim.ema must be in"):
        _module(target, optim={"lr": 1e-2, "ema": 1.5})


def test_the_head_counts_the_targets_own_tokens_only(tiny, corpus):
    """draft.vocab_count=sampled: a prompt's tokens count for nothing (all: every block token, as before)."""
    tok, _ = tiny
    path, rows = corpus
    blocks = load_blocks(str(path), tok, 48, val_fraction=0.2, min_val_blocks=1)
    V = tok.vocab_size
    every = torch.bincount(blocks["train"].flatten(), minlength=V)
    own = sampled_token_counts(blocks, rows, V)
    prompt_only = set()
    for r in rows:
        prompt_only |= set(r["ids"][: r["prompt_tokens"]])
    prompt_only -= {t for r in rows for t in r["ids"][r["prompt_tokens"]:]}
    assert prompt_only and all(own[t] == 0 < every[t] for t in prompt_only if every[t] > 0)
    assert int(own.sum()) < int(every.sum())
    sampled_total = sum(len(r["ids"]) - r["prompt_tokens"] for r in rows)
    assert int(own.sum()) <= sampled_total
    with pytest.raises(DraftsmithError, match="draft.vocab_count"):
        DraftConfig(vocab_count="prompts")


def test_the_report_gives_the_targets_mass_on_the_head_per_set(tiny):
    from omegaconf import OmegaConf

    from draftsmith.train.report import head_mass

    tok, target = tiny
    cfg = OmegaConf.create({"sampler": {"temperature": 0.8, "top_p": 0.95, "top_k": 0},
                            "eval": {"prompt_sets": ["code", "english"], "n_prompts": 2, "max_new_tokens": 8},
                            "data": {"chat_template": False}, "seed": 0})
    V = target.config.vocab_size
    full = head_mass(target, torch.arange(V), tok, cfg)
    assert set(full) == {"code", "english"} and all(abs(v - 1) < 1e-4 for v in full.values())
    half = head_mass(target, torch.arange(V // 2), tok, cfg)
    assert all(0 < half[s] < 1 for s in half)


def test_the_truncated_tv_is_one_minus_the_samplers_acceptance():
    """loss.truncate: 1 - tv equals sampling/rejection.py's acceptance at the sampler's temperature and top-p, which
    the whole-distribution tv does not; its gradient reaches the draft; a loss without tv refuses it."""
    from draftsmith.sampling.probs import SamplingConfig
    from draftsmith.sampling.rejection import teacher_forced_acceptance
    from draftsmith.train.losses import draft_loss, truncated_tv, tv

    g = torch.Generator().manual_seed(0)
    p, q = torch.randn(64, 50, generator=g) * 3, torch.randn(64, 50, generator=g) * 3
    cfg = SamplingConfig(0.8, 0, 0.8)
    acc = teacher_forced_acceptance(p, q, cfg).mean()
    torch.testing.assert_close(1 - truncated_tv(p, q, cfg), acc.float(), atol=1e-5, rtol=0)
    assert abs(float(1 - tv(p, q, 0.8) - acc)) > 0.01
    lp = p.clone().requires_grad_(True)
    total, parts = draft_loss(lp, torch.zeros(64, dtype=torch.long), q, {"tv": 1.0, "forward_kl": 1.0}, 0.8,
                              compile=False, truncate=cfg)
    torch.testing.assert_close(parts["tv"], truncated_tv(p, q, cfg))
    total.backward()
    assert lp.grad.abs().sum() > 0
    _, whole = draft_loss(p, torch.zeros(64, dtype=torch.long), q, {"tv": 1.0}, 0.8, compile=False)
    assert abs(float(whole["tv"] - parts["tv"])) > 0.01  # the default is the whole-distribution tv, unchanged
    with pytest.raises(DraftsmithError, match="loss.truncate=true truncates the tv term"):
        draft_loss(p, torch.zeros(64, dtype=torch.long), q, {"forward_kl": 1.0}, 0.8, compile=False, truncate=cfg)


def test_a_layer_copied_after_a_jump_starts_scaled():
    """draft.init_scale: the draft layer copied from a target layer that does not follow the previous pick (29 after
    1) writes to the residual at that scale; contiguous picks, and every weight at the default 1, are copied as is."""
    target = tiny_llama(vocab=32, layers=6, hidden=32, seed=0)
    plain = build_draft(target, DraftConfig(layers=3, width_ratio=1.0, init="target", init_layers=[0, 1, 5]))
    scaled = build_draft(target, DraftConfig(layers=3, width_ratio=1.0, init="target", init_layers=[0, 1, 5],
                                             init_scale=0.05))
    t = dict(target.named_parameters())
    for n, p in plain.named_parameters():
        src = n.replace("layers.2.", "layers.5.") if "layers.2." in n else n
        torch.testing.assert_close(p, t[src].float())
        q = dict(scaled.named_parameters())[n]
        jumped = "layers.2." in n and ("o_proj" in n or "down_proj" in n)
        torch.testing.assert_close(q, p * 0.05 if jumped else p)
    with pytest.raises(DraftsmithError, match="draft.init_scale"):
        DraftConfig(init_scale=0)


def test_a_warm_draft_writes_pairs_the_target_labels(tiny, tmp_path):
    """Lever 2's writer: the draft's continuations in batches, loops dropped, as prompt + completion pairs that
    data.source= reads (and one teacher pass labels)."""
    from draftsmith.data.corpus import pair_rows
    from draftsmith.data.generation import draft_pairs, repetitive

    assert repetitive([1, 2, 3, 4] * 10) and not repetitive(list(range(40)))
    tok, target = tiny
    out = tmp_path / "pairs.jsonl"
    stats = draft_pairs(target, tok, PROMPTS, out, batch_size=4, max_new_tokens=12, max_rows=6, progress=False)
    assert stats["written"] >= 6 and stats["written"] + stats["dropped"] == 8 and stats["tokens"] > 0
    prompts, completions = pair_rows(str(out))
    assert len(prompts) == stats["written"] and set(prompts) <= set(PROMPTS) and all(completions)


def test_the_switches_train_end_to_end_through_the_entry(tmp_path, monkeypatch):
    """All switches at once on a tiny target's own samples (data=generated, sampled here, not read from a cache):
    the training blocks take the logits the target kept as it sampled them (no teacher pass over those), the run
    trains, validates the average, reports the head's mass per set and exports the average as its best draft.
    (It holds the assertion of the data=generated smoke run folded into it: one corpus sampled, not two.)"""
    import json

    from conftest import run_entry

    monkeypatch.setenv("DRAFTSMITH_HOME", str(tmp_path / "home"))
    res = run_entry("recipe=smoke", "data=generated", "data.generated.n_prompts=32", "data.generated.max_new_tokens=32",
                    "data.generated.batch_size=16", "data.max_documents=null", "data.rows=packed", "optim.name=muon",
                    "optim.ema=0.9", "loss.truncate=true", "draft.vocab_count=sampled", "draft.init_scale=0.5",
                    "eval.baseline=false", "loss.compile=false", f"hydra.run.dir={tmp_path / 'run'}")
    assert res.returncode == 0, res.stderr[-3000:]
    # recipe=smoke keeps the teacher's top-16: the target's sampling kept them, so no block waits for its pass
    filled = re.search(r"(\d+) of (\d+) training blocks take the target's logits kept", res.stdout)
    assert filled and int(filled[1]) > 0.8 * int(filled[2]), res.stdout[-2000:]
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert set(report["head_mass"]) == {"code", "english"} and all(0 < m <= 1 for m in report["head_mass"].values())
    assert "the target's mass on the draft head's" in res.stdout
    assert re.search(r"data.rows=packed: \d+ rows of whole samples \(\d+ samples\)", res.stdout)
    ckpt = torch.load(report["best_checkpoint"], map_location="cpu", weights_only=True)
    assert any(k.startswith("ema.") for k in ckpt["state_dict"])
