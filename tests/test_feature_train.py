"""Training the feature draft: the teacher pass is aligned, its acceptance metric equals a direct computation,
the loss trains it towards the target, and the entry script runs it end to end (refusing what cannot work)."""

import re

import pytest
import torch
from conftest import refusal, run_entry, tiny_llama
from helpers import fit_losses
from test_feature import FeatureDist, feature_draft

from draftsmith.drafts.batch import Batch
from draftsmith.drafts.feature import build_feature_draft, feature_alpha, teacher_pass, unrolled
from draftsmith.sampling.feature import FeatureTap
from draftsmith.sampling.probs import SamplingConfig, process_logits
from draftsmith.sampling.rejection import expected_acceptance
from draftsmith.train.losses import draft_loss


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(vocab=30, layers=4, hidden=32, seed=0, logit_scale=4.0)
    return target, feature_draft(target, scale=3.0)


def test_feature_alpha_equals_direct_computation(pair):
    """Step s at slot j: the draft has the target's features up to position j - s, then s own steps. Computed
    here one context at a time with the unrolled reference, against the target's q for the same label."""
    target, draft = pair
    cfg = SamplingConfig(0.8, 0, 0.95)
    ids = torch.randint(0, 30, (2, 9), generator=torch.Generator().manual_seed(0))
    got = feature_alpha(target, draft, Batch(ids), cfg, steps=3)
    ref = FeatureDist(target, draft, cfg)
    for s in range(3):
        acc = []
        for row in ids.tolist():
            for j in range(s, len(row) - 2):  # slot j predicts x_{j+2}; verified prefix ends at x_{j-s+1}
                verified, drafts = row[: j - s + 2], row[j - s + 2: j + 2]
                with torch.no_grad():
                    q = process_logits(target(input_ids=torch.tensor([row[: j + 2]])).logits[0, -1], cfg)
                acc.append(float(expected_acceptance(ref(verified, drafts).float(), q)))
        assert got[s] == pytest.approx(sum(acc) / len(acc), abs=1e-5)


def test_teacher_pass_alignment(pair):
    target, draft = pair
    ids = torch.randint(0, 30, (2, 8), generator=torch.Generator().manual_seed(1))
    fb = teacher_pass(target, draft.feature_layers, Batch(ids))
    assert torch.equal(fb.tokens, ids[:, 1:-1]) and torch.equal(fb.labels, ids[:, 2:])
    with torch.no_grad():
        q = target(input_ids=ids[:, :4]).logits[:, -1]  # the target's distribution of x_4
    assert torch.allclose(fb.teacher[:, 2], q, atol=1e-5)  # slot 2 predicts x_4
    logits, teacher, labels, sizes = unrolled(draft, fb, 3)
    assert sizes == [12, 10, 8] and len(logits) == len(teacher) == len(labels) == 30  # slots j >= s of 2 rows x 6


def test_fc_starts_as_the_top_feature_at_unit_scale():
    """Raw hidden states dwarf what a new layer adds (docs/defaults.md): fc starts as the highest feature layer's
    state divided by its median RMS per token on the probe, so the fused input has median RMS 1 there."""
    target = tiny_llama(vocab=30, layers=4, hidden=32, seed=0, logit_scale=4.0)
    probe = torch.randint(0, 30, (3, 12), generator=torch.Generator().manual_seed(2))
    draft = build_feature_draft(target, probe=probe)
    with torch.no_grad(), FeatureTap(target, draft.feature_layers) as tap:
        target(input_ids=probe)
        feats = tap.take()
        fused = draft.fuse(feats)
    top = feats[..., 2 * 32:]
    assert torch.allclose(fused * top.pow(2).mean(-1).sqrt().median(), top, atol=1e-5)
    assert fused.pow(2).mean(-1).sqrt().median().item() == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("feature_norm", ["each", "all"])
def test_normed_features_start_the_fused_input_at_unit_scale_and_round_trip(feature_norm, tmp_path):
    """draft.feature_norm (speculators' --fc-norm and its default norm_before_fc): the states pass the draft's
    RMSNorm before fc, fc's top block is scaled to what the norm gives (median RMS 1 again; a scale taken from the
    raw states would be ~1/RMS too small), norm_output feeds the normed output on, and a saved draft keeps all
    three (a loader that dropped them would read the raw states)."""
    from draftsmith.drafts.build import DraftConfig
    from draftsmith.sampling.errors import DraftsmithError
    from draftsmith.sampling.load import load_model

    target = tiny_llama(vocab=30, layers=4, hidden=32, seed=0, logit_scale=4.0)
    probe = torch.randint(0, 30, (3, 12), generator=torch.Generator().manual_seed(2))
    draft = build_feature_draft(target, probe=probe, feature_norm=feature_norm, norm_output=True)
    c = draft.config
    assert (c.fc_norm, c.norm_before_fc, c.norm_output) == (feature_norm == "each", feature_norm == "all", True)
    with torch.no_grad(), FeatureTap(target, draft.feature_layers) as tap:
        target(input_ids=probe)
        feats = tap.take()
        fused = draft.fuse(feats)
        raw_top = feats[..., 2 * 32:]
    assert fused.pow(2).mean(-1).sqrt().median().item() == pytest.approx(1.0, abs=1e-4)
    assert not torch.allclose(fused * raw_top.pow(2).mean(-1).sqrt().median(), raw_top, atol=1e-3)  # normed first
    hidden = torch.randn(1, 3, 32)
    assert torch.allclose(draft.own_feature(hidden), draft.norm(hidden))
    draft.save_pretrained(tmp_path / "d")
    back = load_model(str(tmp_path / "d"), "fp32")
    assert (back.config.fc_norm, back.config.norm_before_fc, back.config.norm_output) == \
        (c.fc_norm, c.norm_before_fc, True)
    with torch.no_grad():
        assert torch.allclose(back.fuse(feats), fused, atol=1e-5)
    with pytest.raises(DraftsmithError, match="feature_norm"):
        DraftConfig(feature_norm="sometimes")
    with pytest.raises(DraftsmithError, match="kind=feature_head"):
        DraftConfig(kind="independent", feature_norm=feature_norm)


def test_training_moves_the_draft_towards_the_target():
    """A few optimiser steps of the recipe's loss on target samples raise every step's acceptance; the target's
    weights do not change."""
    target = tiny_llama(vocab=30, layers=4, hidden=32, seed=0, logit_scale=4.0)
    draft = build_feature_draft(target, freeze_head=False)
    before_target = {k: v.clone() for k, v in target.state_dict().items()}
    cfg = SamplingConfig(0.8)
    from draftsmith.sampling import autoregressive_generate

    gen = autoregressive_generate(target, torch.zeros(16, 1, dtype=torch.long), max_new_tokens=24, temperature=0.8,
                                  generator=torch.Generator().manual_seed(0))
    b = Batch(torch.cat([torch.zeros(16, 1, dtype=torch.long), torch.stack(gen.tokens)], 1).clone())
    start = feature_alpha(target, draft, b, cfg, steps=3)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(60):
        fb = teacher_pass(target, draft.feature_layers, b)
        logits, teacher, labels, _ = unrolled(draft, fb, 3)
        loss, _ = draft_loss(logits, labels, teacher, {"tv": 1.0, "forward_kl": 1.0}, 0.8, compile=False)
        opt.zero_grad()
        loss.backward()
        opt.step()
    end = feature_alpha(target, draft, b, cfg, steps=3)
    assert all(e > s + 0.05 for s, e in zip(start, end)), (start, end)
    assert all(torch.equal(v, before_target[k]) for k, v in target.state_dict().items())


def test_kept_features_spare_the_target_after_the_first_epoch(tmp_path):
    """Real Lightning fit of a pruned feature draft, 3 epochs of 2 batches: with loss.teacher_topk the target runs
    in the first epoch only (its features and head-restricted logits kept), and the losses follow those of the
    run that asks the target every step (k = V - 1 leaves out one token's mass, fp16 rounds the rest)."""
    from draftsmith.data.teacher import TeacherCache
    from draftsmith.train.module import DraftModule

    blocks = torch.randint(0, 30, (8, 12), generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(blocks.flatten(), minlength=30).double()
    losses = {}
    for cached in (False, True):
        target = tiny_llama(vocab=30, layers=4, hidden=32, seed=0, logit_scale=3.0)
        draft = build_feature_draft(target, draft_vocab=20, token_counts=counts)
        calls = []
        target.register_forward_hook(lambda m, a, k, o: calls.append(1), with_kwargs=True)
        loss = {"distill": True, "temperature": 1.0, "weights": {"tv": 1, "forward_kl": 1}, "compile": False}
        cache = TeacherCache(8, 11, 29, 30, columns=draft.token_ids(), features=3 * 32) if cached else None
        module = DraftModule(draft, target, loss=loss, optim={"lr": 1e-2, "warmup_steps": 1},
                             sampler={"temperature": 1.0}, max_steps=6, unroll=2, teacher_cache=cache)
        losses[cached] = fit_losses(module, blocks, tmp_path)
        assert len(calls) == (2 if cached else 6)
    assert len(losses[True]) == 6 and losses[True][0] == pytest.approx(losses[False][0], rel=1e-2)
    assert losses[True] == pytest.approx(losses[False], rel=5e-2)  # a row or a feature mixed up: far off


def test_unrolled_steps_weigh_step_decay_to_the_power_of_the_step(pair):
    """draft.step_decay (EAGLE-3's 0.8): step s of the training-time test weighs step_decay ** s in the loss, and
    step_decay = 1 leaves the plain mean; a decay outside (0, 1] is refused."""
    from draftsmith.drafts.build import DraftConfig
    from draftsmith.train.module import DraftModule

    target, draft = pair
    ids = torch.randint(0, 30, (2, 10), generator=torch.Generator().manual_seed(3))
    loss = {"distill": True, "temperature": 1.0, "weights": {"tv": 1}, "compile": False}
    for decay in (1.0, 0.5):
        module = DraftModule(draft, target, loss=loss, optim={"lr": 1e-3}, sampler={"temperature": 1.0},
                             max_steps=1, unroll=3, step_decay=decay)
        logits, _, _, weights = module.objective.train_outputs(module, Batch(ids), None)
        if decay == 1.0:
            assert weights is None
            continue
        sizes = [2 * (8 - s) for s in range(3)]  # slot j of step s needs j >= s; 8 slots per row
        assert len(weights) == len(logits) == sum(sizes)
        assert torch.equal(weights, torch.cat([torch.full((n,), 0.5 ** s) for s, n in enumerate(sizes)]))
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="step_decay"):
            DraftConfig(kind="feature_head", step_decay=bad)


def _relative_noise(noisy: torch.Tensor, clean: torch.Tensor) -> torch.Tensor:
    """(noisy - clean) over the per-token RMS of each of the three feature blocks of `clean`."""
    blocks = clean.unflatten(-1, (3, -1))
    return (noisy.unflatten(-1, (3, -1)) - blocks) / blocks.pow(2).mean(-1, keepdim=True).sqrt()


def test_feature_noise_is_relative_to_each_blocks_scale_and_only_in_training(pair, monkeypatch):
    """draft.feature_noise (EAGLE-1's): each of the three feature blocks gets U(-a, a) x its own per-token RMS (a
    block 1e4 times larger gets noise 1e4 times larger), centred, fresh each call; training reads the noisy
    features, and a noise of 0 or outside [0, 1) is none or refused."""
    from draftsmith.drafts.build import DraftConfig
    from draftsmith.drafts.feature import noisy_features
    from draftsmith.train import objective as module_lib
    from draftsmith.train.module import DraftModule

    g = torch.Generator().manual_seed(0)
    scales = torch.tensor([1e4, 1.0, 20.0])
    x = (torch.randn(4, 50, 3, 16, generator=g) * scales[:, None]).flatten(-2)
    a, b = noisy_features(x, 3, 0.1), noisy_features(x, 3, 0.1)
    assert not torch.equal(a, b)
    rel = _relative_noise(a, x)
    assert rel.abs().max() <= 0.1 + 1e-5 and rel.abs().max() > 0.09  # uniform up to the bound, no further
    assert rel.mean().abs() < 0.005 and rel.std().item() == pytest.approx(0.1 / 3 ** 0.5, rel=0.05)
    assert noisy_features(x.bfloat16(), 3, 0.1).dtype == torch.bfloat16  # kept features stay half

    target, draft = pair
    ids = torch.randint(0, 30, (2, 10), generator=torch.Generator().manual_seed(3))
    loss = {"distill": True, "temperature": 1.0, "weights": {"tv": 1}, "compile": False}
    read, real = [], module_lib.unrolled

    def spy(d, fb, steps):  # what the draft is given to read
        read.append(fb.features)
        return real(d, fb, steps)

    monkeypatch.setattr(module_lib, "unrolled", spy)
    for noise in (0.0, 0.2):
        module = DraftModule(draft, target, loss=loss, optim={"lr": 1e-3}, sampler={"temperature": 1.0},
                             max_steps=1, unroll=2, feature_noise=noise)
        module.objective.train_outputs(module, Batch(ids), None)
    clean = teacher_pass(target, draft.feature_layers, Batch(ids)).features
    assert torch.equal(read[0], clean)
    rel = _relative_noise(read[1], clean)
    assert 0.15 < rel.abs().max() <= 0.2 + 1e-4
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="feature_noise"):
            DraftConfig(kind="feature_head", feature_noise=bad)


@pytest.mark.slow  # among the longest: the default suite stays under its 12 minutes
def test_entry_trains_a_feature_draft(tmp_path, monkeypatch):
    """On the target's own samples (as recipe=feature_head): its logits and features kept as it sampled them fill
    the teacher cache, so the first epoch runs no teacher pass over those blocks."""
    from draftsmith.sampling.feature import FeatureDraft
    from draftsmith.sampling.load import load_model

    monkeypatch.setenv("DRAFTSMITH_HOME", str(tmp_path / "home"))  # sampled here, not continued from a cache
    run = tmp_path / "run"
    r = run_entry("recipe=smoke", "draft=feature_head", "draft.draft_vocab=128", "draft.vocab_source=stdlib",
                  "data=generated", "data.generated.n_prompts=40", "data.generated.max_new_tokens=48",
                  f"hydra.run.dir={run}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "feature draft: 1 layer" in r.stdout + r.stderr
    filled = re.search(r"(\d+) of (\d+) training blocks take the target's logits and features kept", r.stdout)
    assert filled and int(filled[1]) > 0.8 * int(filled[2])
    draft = load_model(str(run / "best_draft"))
    assert isinstance(draft, FeatureDraft)


def test_a_bad_draft_setting_is_refused_before_the_corpus_is_sampled(tmp_path, monkeypatch):
    """The draft's settings are checked with the rest of the config: a run with data=generated used to sample the
    whole corpus first, and only then refuse them."""
    home = tmp_path / "home"
    monkeypatch.setenv("DRAFTSMITH_HOME", str(home))
    message = refusal(tmp_path / "run", "recipe=smoke", "draft=feature_head", "data=generated",
                      "draft.feature_noise=2")
    assert message.startswith("draft.feature_noise must be in [0, 1)")
    assert not (home / "generated").exists()


@pytest.mark.parametrize("override, message", [("data=mixed", "feature draft cannot sample alone"),
                                               ("sampler.compile=true", "a feature draft validates eagerly")])
def test_what_a_feature_draft_cannot_do_is_refused(override, message):
    from conftest import ROOT
    from hydra import compose, initialize_config_dir

    from draftsmith.sampling.errors import DraftsmithError
    from draftsmith.sampling.load import load_tokenizer
    from draftsmith.train.data import check_data

    with initialize_config_dir(config_dir=str(ROOT / "recipes"), version_base="1.3"):
        cfg = compose("draft", ["recipe=smoke", "draft=feature_head", override])
    with pytest.raises(DraftsmithError, match=message):
        check_data(cfg, load_tokenizer("tiny-random"))
