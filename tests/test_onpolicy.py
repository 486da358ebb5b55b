"""On-policy data (DistillSpec) and the on-distribution validation metric: batches really come from the draft, the
mixture holds its fraction, the target is never updated, `alpha_on_target` equals a direct computation, and bad
data settings are refused before training starts."""

import json

import lightning as L
import pytest
import torch
from conftest import refusal, run_entry, tiny_llama
from torch.utils.data import DataLoader, TensorDataset

from draftsmith.drafts.batch import Batch
from draftsmith.drafts.evaluate import alpha_on_samples, target_samples
from draftsmith.sampling.probs import SamplingConfig, process_logits
from draftsmith.train.onpolicy import OnPolicy

V = 32


def one_token_draft(token: int, vocab: int = V):
    """A draft whose every distribution is (numerically) a point mass on `token`."""
    model = tiny_llama(vocab=vocab, seed=3)
    head = torch.nn.Linear(model.config.hidden_size, vocab, bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.fill_(-50.0)
        head.bias[token] = 50.0
    model.lm_head = head
    return model


def openings(ids, n):
    return ids[:, :n], torch.ones_like(ids[:, :n])


def test_on_policy_rows_are_the_drafts_own_samples():
    ids = torch.randint(0, V, (4, 12), generator=torch.Generator().manual_seed(0))
    ids[ids == 7] = 8
    op = OnPolicy(1.0, openings(ids, 5), temperature=0.8, top_p=0.95)
    b = op(one_token_draft(7), ids)
    assert b.ids.shape == ids.shape
    pool = {tuple(r) for r in ids[:, :5].tolist()}
    assert all(tuple(r) in pool for r in b.ids[:, :5].tolist())  # prompts are corpus openings
    assert (b.ids[:, 5:] == 7).all()  # everything after the prompt is what the draft emitted
    assert b.loss_mask.shape == (4, 11)
    assert not b.loss_mask[:, :4].any() and b.loss_mask[:, 4:].all()  # the loss sees only the draft's tokens
    assert not b.ids.is_inference()  # usable in a training forward


@pytest.mark.parametrize("fraction,batch,rows", [(0.0, 4, 0), (0.5, 4, 2), (0.25, 8, 2), (1.0, 3, 3)])
def test_mixture_holds_its_fraction(fraction, batch, rows):
    ids = torch.randint(0, V, (batch, 10), generator=torch.Generator().manual_seed(1))
    ids[ids == 7] = 8
    b = OnPolicy(fraction, openings(ids, 4), temperature=1.0)(one_token_draft(7), ids)
    changed = (b.ids != ids).any(1)
    assert int(changed.sum()) == rows and changed[:rows].all()
    assert torch.equal(b.ids[rows:], ids[rows:])  # the fixed share is the corpus batch untouched
    if rows:
        assert int((~b.loss_mask).sum()) == rows * 3
    else:
        assert b.loss_mask is None


def test_prompts_from_a_pool_are_left_padded_and_masked():
    pool = (torch.tensor([[0, 0, 5, 6], [1, 2, 3, 4]]), torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]))
    b = OnPolicy(1.0, pool, temperature=1.0)(one_token_draft(7), torch.zeros(6, 9).long())
    assert (b.ids[:, 4:] == 7).all()
    padded = (b.mask[:, :2] == 0).all(1)
    assert padded.any() and torch.equal(b.ids[padded, 2:4], torch.tensor([[5, 6]]).expand(int(padded.sum()), 2))
    assert b.positions()[padded][0, 2:5].tolist() == [0, 1, 2]  # RoPE positions skip the padding


def test_out_of_range_fraction_is_refused():
    for f in (-0.1, 1.5):
        with pytest.raises(ValueError, match=r"on_policy_fraction must be in \[0, 1\]"):
            OnPolicy(f, openings(torch.zeros(2, 5).long(), 4), temperature=1.0)


def test_on_policy_rows_start_after_the_warm_up():
    ids = torch.randint(0, V, (4, 10), generator=torch.Generator().manual_seed(4))
    ids[ids == 7] = 8
    op = OnPolicy(0.5, openings(ids, 4), temperature=1.0, start=0.4)
    assert torch.equal(op(one_token_draft(7), ids, progress=0.39).ids, ids)  # warm-up: the corpus batch as is
    assert (op(one_token_draft(7), ids, progress=0.4).ids[:2, 4:] == 7).all()
    with pytest.raises(ValueError, match=r"on_policy_from must be in \[0, 1\)"):
        OnPolicy(0.5, openings(ids, 4), temperature=1.0, start=1.0)


def test_rows_are_sampled_a_buffer_at_a_time():
    """Decoding is sequential in tokens and nearly free in rows: 2 rows a step from a buffer of 8 means the draft
    samples once every 4 steps, and every row is used once."""
    ids = torch.randint(0, V, (4, 10), generator=torch.Generator().manual_seed(2))
    op = OnPolicy(0.5, openings(ids, 4), temperature=1.0, buffer=8)
    draft = one_token_draft(7)
    sampled = []
    for _ in range(8):
        op(draft, ids)
        sampled.append(op.sampled_rows)
    assert sampled == [8, 8, 8, 8, 16, 16, 16, 16]


def test_on_policy_training_updates_the_draft_never_the_target(tmp_path):
    from draftsmith.drafts.build import DraftConfig, build_draft
    from draftsmith.train.module import DraftModule

    target = tiny_llama(vocab=V, layers=2, hidden=32, seed=0, logit_scale=3.0)
    draft = build_draft(target, DraftConfig(layers=1, width_ratio=1.0, init="target"))
    before_t = {k: v.clone() for k, v in target.state_dict().items()}
    before_d = {k: v.clone() for k, v in draft.state_dict().items()}
    calls = []
    op = OnPolicy(0.5, (torch.randint(0, V, (8, 4)), torch.ones(8, 4).long()), temperature=1.0, buffer=4)
    real = op.__call__
    spy = lambda self, d, ids, progress: calls.append(progress) or real(d, ids, progress)  # noqa: E731
    op_calls = type("Spy", (), {"fraction": 0.5, "__call__": spy, "seed_rank": lambda self, r: op.seed_rank(r)})()
    loss = {"distill": True, "temperature": 1.0, "weights": {"tv": 1, "forward_kl": 1}, "compile": False}
    module = DraftModule(draft, target, loss=loss, optim={"lr": 1e-2, "warmup_steps": 1},
                         sampler={"temperature": 1.0}, max_steps=4, on_policy=op_calls)
    data = DataLoader(TensorDataset(torch.randint(0, V, (16, 12))), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", max_steps=4, logger=False, enable_progress_bar=False,
                        default_root_dir=tmp_path, limit_val_batches=0, enable_checkpointing=False)
    trainer.fit(module, data)
    assert len(calls) == 4 and calls == sorted(calls) and 0 <= calls[0] < calls[-1] <= 1  # progress handed on
    assert all(torch.equal(before_t[k], v) for k, v in target.state_dict().items())
    assert any(not torch.equal(before_d[k], v) for k, v in draft.state_dict().items())


def test_a_mixed_batch_runs_the_target_on_the_drafts_rows_only_and_keeps_the_corpus_rows():
    """With a teacher cache the corpus rows of a mixed batch come from it (after their first visit), and the
    target scores only the draft's fresh rows: the logits equal a direct teacher pass on each part."""
    from draftsmith.data.teacher import TeacherCache
    from draftsmith.drafts.build import DraftConfig, build_draft
    from draftsmith.train.module import DraftModule

    target = tiny_llama(vocab=V, layers=2, hidden=32, seed=0, logit_scale=3.0)
    draft = build_draft(target, DraftConfig(layers=1, width_ratio=1.0, init="target"))
    cache = TeacherCache(8, 11, V - 1, V)
    module = DraftModule(draft, target, loss={"distill": True, "weights": {"tv": 1}}, optim={}, sampler={
        "temperature": 1.0}, max_steps=1, teacher_cache=cache)
    ids = torch.randint(0, V, (4, 12), generator=torch.Generator().manual_seed(5))
    rows = torch.tensor([3, 1, 6, 0])
    module.objective._target_logits(module, Batch(ids), rows)  # the blocks' first visit fills the cache
    b = OnPolicy(0.5, openings(ids, 4), temperature=1.0)(one_token_draft(7), ids)
    seen = []
    hook = target.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].shape[0]), with_kwargs=True)
    got = module.objective._target_logits(module, b, rows)
    hook.remove()
    assert b.sampled == 2 and seen == [2]  # one pass, over the draft's two rows
    with torch.no_grad():
        fresh = Batch(b.ids[:2], None if b.mask is None else b.mask[:2]).logits(target)
        kept = torch.log_softmax(Batch(ids[2:]).logits(target), -1)
    assert torch.equal(got[:2], fresh)
    assert (got[2:] - kept).abs().max() < 0.02  # fp16-kept log-probabilities of the corpus rows
    assert cache.hits == 2 and cache.misses == 4


def direct_alpha(target, draft, samples: Batch, cfg) -> float:
    """Row by row, unpadded, position by position: mean of sum_x min(p, q) over the sampled tokens."""
    accs = []
    for i in range(len(samples.ids)):
        real = samples.mask[i].bool()
        seq = samples.ids[i][real]
        first = int((~samples.mask[i][: samples.mask[i].argmax()].bool()).sum())  # left padding
        labels = samples.loss_mask[i].nonzero().squeeze(1) + 1 - first  # label positions in the unpadded row
        for t in labels.tolist():
            with torch.no_grad():
                p = process_logits(draft(input_ids=seq[None, :t]).logits[0, -1], cfg)
                q = process_logits(target(input_ids=seq[None, :t]).logits[0, -1], cfg)
            accs.append(float(torch.minimum(p, q).sum()))
    return sum(accs) / len(accs)


def test_alpha_on_target_equals_a_direct_computation():
    target = tiny_llama(vocab=V, layers=2, hidden=32, seed=0, logit_scale=3.0)
    draft = tiny_llama(vocab=V, layers=1, hidden=16, seed=1, logit_scale=2.0)
    prompts = torch.tensor([[0, 0, 3, 4, 5], [1, 2, 3, 4, 5], [0, 9, 8, 7, 6]])
    mask = (torch.arange(5)[None] >= torch.tensor([[2], [0], [1]])).long()
    samples = target_samples(target, prompts, mask, max_new_tokens=6, temperature=0.9, top_p=0.95,
                             eos_token_id=2, pad_token_id=0, seed=4)
    assert samples.loss_mask.sum() > 6  # sampled tokens are scored (EOS may end a row early)
    cfg = SamplingConfig(0.9, 0, 0.95)
    got = alpha_on_samples(target, draft, samples, cfg)
    assert 0 < got < 1
    assert got == pytest.approx(direct_alpha(target, draft, samples, cfg), abs=1e-5)
    assert alpha_on_samples(target, target, samples, cfg) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("overrides,msg", [
    (["data.on_policy_fraction=1.5"], "on_policy_fraction must be in [0, 1]"),
    (["data=mixed", "data.on_policy_from=1"], "on_policy_from must be in [0, 1)"),
    (["sampler.on_target_tokens=0"], "needs its sample set"),
    (["data=on_policy", "loss=ce"], "choose a distillation loss"),
    (["data=on_policy", "data.prompt_tokens=64"], "leaves no room"),
    (["data=on_policy", "data.chat_template=true"], "has no chat template"),
    (["data=generated", "data.generated.n_prompts=1", "data.generated.max_new_tokens=8"], "less than one batch"),
    (["data=generated", "data.generated.max_minutes=0"], "max_minutes must be > 0"),
    (["data=generated", "data.generated.engine=sglang"], "data.generated.engine must be draftsmith, vllm or auto"),
    (["data=generated", "data.generated.engine=vllm", "sampler.top_k=20"], "samples with temperature and top-p"),
])
def test_bad_data_settings_fail_before_training(tmp_path, overrides, msg):
    """Refused in one line before a checkpoint is written (in-process, conftest.refusal; the exit status and the
    `error:` line are tests/test_train.py's)."""
    assert msg in refusal(tmp_path / "run", "recipe=smoke", *overrides)


@pytest.mark.parametrize("content,msg", [("", "holds no usable prompt"), ('{"text": "x"}\n', "'prompt'"),
                                         ("not json\n", "not a JSON object")])
def test_unusable_prompts_file_is_refused(tmp_path, content, msg):
    f = tmp_path / "prompts.jsonl"
    f.write_text(content)
    assert msg in refusal(tmp_path / "run", "recipe=smoke", "data=on_policy", f"data.prompts={f}")


@pytest.mark.slow
def test_mixed_recipe_with_a_prompts_file_trains_and_monitors_alpha_on_target(tmp_path):
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"def f{i}(x):\n    return"}) + "\n" for i in range(5)))
    out = tmp_path / "run"
    res = run_entry("recipe=smoke", "data=mixed", f"data.prompts={f}", f"hydra.run.dir={out}", "logger=csv")
    assert res.returncode == 0, res.stderr[-3000:]
    assert (out / "val_target_samples.safetensors").is_file()
    report = json.loads((out / "report.json").read_text())
    assert report["monitor"] == "val/alpha_on_target" and 0 < report["best_score"] <= 1
    rows = (out / "csv" / "metrics.csv").read_text()
    assert "train/on_policy_s" in rows and "val/alpha_on_target" in rows


@pytest.mark.parametrize("name", ["train", "broad"])
def test_shipped_training_prompts_hold_no_eval_prompt_and_any_prefix_is_half_code(name):
    """The code and english sets measure drafts on prompts they never trained on: no training prompt is one of
    them or defines one of their functions. A time-limited sampler reaches a prefix of broad.jsonl: past its 126
    hand-written prompts (train.jsonl's, English first), any prefix is about half code."""
    from draftsmith.sampling.prompts import load_prompts

    held = [r["prompt"] for s in ("code", "english") for r in load_prompts(s)]
    names = {p.split("def ")[1].split("(")[0] for p in held if "def " in p} - {"__init__"}
    rows = load_prompts(name)
    assert not {r["prompt"] for r in rows} & set(held)
    assert not any(f"def {n}(" in r["prompt"] for r in rows for n in names)
    for n in (300, len(rows) // 2, len(rows)) if name == "broad" else ():
        share = sum(r["domain"] == "code" for r in rows[:n]) / n
        assert 0.35 < share < 0.65, (n, share)
