"""The calibrated linear kernels (sampling/kernels.py): the same numbers as F.linear up to rounding, on every path
(one row, a few, many, under autograd), never stale after an in-place update, bound to the right module after a
deepcopy, and exact speculative decoding on top of them."""

import copy
import json
import time

import pytest
import torch
from torch import nn

from draftsmith.sampling import autoregressive_generate, speculative_generate
from draftsmith.sampling.kernels import FEW_ROWS, KERNELS, ROWS, calibrate, install
from tests.conftest import tiny_llama

FORCED = [{r: ("onednn" if r == 1 else "transposed") for r in ROWS},
          {r: ("transposed" if r == 1 else "onednn") for r in ROWS}]


@pytest.mark.parametrize("force", FORCED)
def test_kernels_match_f_linear_on_every_path(force):
    plain = tiny_llama(vocab=64, layers=2, hidden=32, seed=0)
    fast = copy.deepcopy(plain)
    assert install(fast, force=force)  # every Linear of the model got them
    for rows in (1, 3, FEW_ROWS + 6):
        ids = torch.randint(0, 64, (1, rows))
        with torch.inference_mode():
            assert torch.allclose(fast(ids).logits, plain(ids).logits, atol=1e-5, rtol=1e-5)
    # training through a patched module: F.linear's autograd, the same gradient
    for m in (plain, fast):
        m.lm_head.weight.requires_grad_(True)
        m(torch.tensor([[1, 2]])).logits.logsumexp(-1).sum().backward()
    assert torch.allclose(fast.lm_head.weight.grad, plain.lm_head.weight.grad, atol=1e-6)


def test_onednn_copy_follows_in_place_updates_and_deepcopy_rebinds():
    model = tiny_llama(vocab=64, layers=1, hidden=32, seed=0)
    install(model, force=dict.fromkeys(ROWS, "onednn"))
    x = torch.randn(1, 1, 32)
    head = model.lm_head
    with torch.inference_mode():
        before = head(x)
    with torch.no_grad():
        head.weight.mul_(2)  # an optimizer step is an in-place update like this one
    with torch.inference_mode():
        assert torch.allclose(head(x), 2 * before, atol=1e-5)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.lm_head.weight.zero_()
    with torch.inference_mode():
        assert torch.count_nonzero(twin.lm_head(x)) == 0  # the copy multiplies by its own weight
        assert torch.allclose(head(x), 2 * before, atol=1e-5)  # and the original by its own


def test_calibrate_picks_a_kernel_per_row_count_and_skips_small_models():
    layer = nn.Sequential(nn.Linear(576, 2048, bias=False)).requires_grad_(False)
    table = install(layer, step=_timed(layer), cache=None)
    assert set(table.values()) <= set(KERNELS) and (not table or set(table) == set(ROWS))
    slow_linear = {}
    calibrate(lambda rows: 1.0 if slow_linear[rows] == "linear" else 0.5, slow_linear, rows=(1, 4), reps=1)
    assert slow_linear == {1: "transposed", 4: "transposed"}  # the first of the kernels that beat F.linear
    tie = {}
    calibrate(lambda rows: 1.0, tie, rows=(1,), reps=1)
    assert tie == {1: "linear"}  # F.linear unless beaten by 10%
    assert install(tiny_llama(vocab=64, layers=1, hidden=32)) == {}  # nothing to gain below MIN_BYTES


def _timed(module):
    def step(rows):
        x = torch.randn(rows, 576)
        t = time.perf_counter()
        module(x)
        return time.perf_counter() - t

    return step


@pytest.mark.parametrize("force", FORCED)
def test_greedy_speculative_on_patched_models_equals_plain_greedy(force):
    target = tiny_llama(vocab=32, layers=2, hidden=32, seed=0, logit_scale=4.0)
    draft = tiny_llama(vocab=32, layers=1, hidden=16, seed=3, logit_scale=4.0)
    install(target, force=force)
    install(draft, force=force)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    spec = speculative_generate(target, draft, ids, max_new_tokens=24, k=3, temperature=0)
    ref = autoregressive_generate(target, ids, max_new_tokens=24, temperature=0)
    assert [t.tolist() for t in spec.tokens] == [t.tolist() for t in ref.tokens]
    assert spec.stats.accepted < spec.stats.drafted  # rejections happened, so the verify path was exercised


def test_choices_are_timed_once_per_machine_and_a_damaged_cache_is_timed_again(tmp_path, monkeypatch):
    cache = tmp_path / "kernels.json"
    layer = nn.Sequential(nn.Linear(576, 2048, bias=False)).requires_grad_(False)
    install(layer, step=_timed(layer), cache=cache)
    (key, table), = json.loads(cache.read_text()).items()
    assert "2048x576" in key and set(map(int, table)) == set(ROWS)

    def untimed(*a, **k):
        raise AssertionError("timed again although the cache holds the table")

    monkeypatch.setattr("draftsmith.sampling.kernels.calibrate", untimed)
    install(nn.Sequential(nn.Linear(576, 2048, bias=False)), step=untimed, cache=cache)
    cache.write_text("{not json")
    with pytest.raises(AssertionError, match="timed again"):
        install(nn.Sequential(nn.Linear(576, 2048, bias=False)), step=untimed, cache=cache)
