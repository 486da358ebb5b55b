"""k="auto": each loop drafts until the cost model says stop, from the draft's probabilities and the running
acceptance; exact because the decision reads the draft's side only."""

from collections import defaultdict

import pytest
import torch
from conftest import tiny_llama
from helpers import pvalue, sample_counts
from test_exactness import Dist, pair, speculative_sequences, target_sequences, tv  # noqa: F401  (pair: fixture)

from draftsmith.sampling import autoregressive_generate, speculative_generate
from draftsmith.sampling.kauto import KChooser
from draftsmith.sampling.probs import SamplingConfig

CHEAP = {"c": 0.05, "v": {k: 1.0 + 0.02 * k for k in range(1, 9)}}


def drafted(chooser, rows, confs, bound=8):
    """How many tokens the chooser lets the draft propose when its i-th token has probability confs[i]."""
    stop = chooser.stopper(rows, bound)
    for i in range(1, bound + 1):
        if stop([torch.full((len(rows),), confs[min(i, len(confs)) - 1], dtype=torch.float64)
                 for i in range(1, i + 1)]):
            return i


def test_chooser_stops_where_the_speed_up_model_says():
    t = tiny_llama()
    rows = torch.arange(2)
    hi = KChooser(t, t, 2, 8, CHEAP, alpha_prior=0.9)
    lo = KChooser(t, t, 2, 8, {"c": 0.6, "v": CHEAP["v"]}, alpha_prior=0.2)
    assert drafted(hi, rows, [0.5]) >= 6 and drafted(lo, rows, [0.5]) == 1
    assert drafted(hi, rows, [0.5], bound=3) == 3
    zeros, half = torch.zeros(2, dtype=torch.long), torch.full((2, 4), 0.5)
    for _ in range(20):  # rows that keep rejecting everything pull K down
        hi.update(rows, zeros, 4, half, torch.zeros(2, 4))
    assert drafted(hi, rows, [0.5]) <= 2
    with pytest.raises(ValueError, match="alpha_prior"):
        KChooser(t, t, 1, 8, CHEAP, alpha_prior=1.5)


def test_chooser_drafts_on_after_sure_tokens_and_stops_after_an_unsure_one():
    """Calibrated on a draft whose sure tokens (p 0.95) are accepted and unsure ones (p 0.15) rejected."""
    t = tiny_llama()
    rows = torch.arange(2)
    c = KChooser(t, t, 2, 8, CHEAP, alpha_prior=0.6)
    for _ in range(10):
        c.update(rows, torch.full((2,), 2), 4, torch.tensor([[0.95, 0.95, 0.15, 0.15]] * 2),
                 torch.tensor([[1.0, 1.0, 0.0, 0.0]] * 2))
    assert drafted(c, rows, [0.95] * 8) == 8
    assert drafted(c, rows, [0.95, 0.15]) == 2
    assert drafted(c, rows, [0.15]) == 1


def test_cost_model_gaps_are_interpolated():
    """A bench sweep of K 1, 2, 4 gives v(1), v(2), v(4); k="auto" may still stop at 3."""
    c = KChooser(tiny_llama(), None, 1, 8, {"c": 0.1, "v": {"1": 1.1, "2": 1.2, "4": 1.4}}, alpha_prior=0.5)
    assert c.k_max == 4
    assert torch.allclose(c.time, torch.tensor([1.0, 1.2, 1.4, 1.6, 1.8], dtype=torch.float64))


@pytest.mark.parametrize("setting", [(1.0, 0, 1.0), (0.8, 0, 0.9)])
def test_a_stop_that_reads_the_drafted_tokens_keeps_the_output_exact(pair, setting):  # noqa: F811
    """Enumerated: ending the drafting where k="auto"'s own rule (`KChooser.stopper`, calibrated as a run calibrates
    it) says, on the draft's probabilities of the tokens drafted so far, changes only how many tokens each loop
    proposes, never the distribution of what is emitted; the rule both stops and drafts on in the enumeration."""
    target, draft = pair
    cfg = SamplingConfig(*setting)
    q, p = Dist(target, cfg), Dist(draft, cfg)
    prompt, budget = [1, 3], 4
    rows = torch.arange(1)
    chooser = KChooser(target, draft, 1, 3, CHEAP, alpha_prior=0.6)
    for _ in range(10):  # sure tokens (p 0.95) accepted, unsure ones (p 0.15) rejected, as in the test above
        chooser.update(rows, torch.full((1,), 2), 4, torch.tensor([[0.95, 0.95, 0.15, 0.15]]),
                       torch.tensor([[1.0, 1.0, 0.0, 0.0]]))
    kstop, seen = chooser.stopper(rows, 3), {}
    decisions = []

    def stop(confs):  # the product's rule, fed what the loop feeds it: one (rows,) tensor per drafted token
        # it reads the confidences through their bins only, so one call per bin sequence (the first met) answers
        # the enumeration's many calls with the product's own decision
        key = tuple(min(int(c * chooser.BINS), chooser.BINS - 1) for c in confs)
        if key not in seen:
            seen[key] = kstop([torch.tensor([c], dtype=torch.float64) for c in confs])
        decisions.append(seen[key])
        return decisions[-1]

    want = target_sequences(q, prompt, budget, None)
    got = speculative_sequences(p, q, prompt, budget, 3, None, stop=stop)
    assert True in decisions and False in decisions
    assert abs(sum(got.values()) - 1) < 1e-6 and tv(got, want) < 1e-6


def test_auto_k_passes_chi_square(pair, monkeypatch):  # noqa: F811
    """k="auto" ends some loops' drafting before their bound (the K a fixed-K loop would draft there: the budget
    also shortens loops, so K varying alone proves nothing) and drafts more than one token in others, and its output
    passes the chi-square against the target's exact sequence probabilities."""
    target, draft = pair
    prompt, budget, setting = [1, 3], 3, (0.9, 0, 0.95)
    exact = target_sequences(Dist(target, SamplingConfig(*setting)), prompt, budget, None)
    g = torch.Generator().manual_seed(11)
    counts, ks, bounds = defaultdict(int), [], []
    stopper = KChooser.stopper
    monkeypatch.setattr(KChooser, "stopper", lambda self, active, bound: (bounds.append(bound),
                                                                          stopper(self, active, bound))[1])
    # a cheap draft drafts to its bound; a dear one (c 0.2, a prior of 0.5) ends the first loop after one token:
    # both runs' samples are the target's distribution, so they pool
    for cost, prior in ((CHEAP, 0.7), ({"c": 0.2, "v": CHEAP["v"]}, 0.5)):
        c, stats = sample_counts(
            lambda ids: speculative_generate(target, draft, ids, max_new_tokens=budget, k="auto", cost=cost,
                                             alpha_prior=prior, temperature=setting[0], top_p=setting[2],
                                             generator=g),
            25_000, budget, prompt)
        for s, n in c.items():
            counts[s] += n
        ks += stats.k_per_loop
    assert len(ks) == len(bounds) and any(k < b for k, b in zip(ks, bounds)) and max(ks) > 1, (ks, bounds)
    assert 0 < stats.alpha < 1
    assert pvalue(counts, exact) > 1e-3


def test_auto_k_greedy_equals_target_and_measures_its_own_costs():
    target = tiny_llama(vocab=40, layers=3, seed=0, logit_scale=4.0)
    draft = tiny_llama(vocab=40, layers=1, hidden=16, seed=1, logit_scale=4.0)
    ids = torch.randint(0, 40, (3, 5), generator=torch.Generator().manual_seed(0))
    want = autoregressive_generate(target, ids, max_new_tokens=20, temperature=0)
    got = speculative_generate(target, draft, ids, max_new_tokens=20, k="auto", temperature=0)  # cost measured
    assert [t.tolist() for t in got.tokens] == [t.tolist() for t in want.tokens]
    assert got.stats.k_per_loop and all(1 <= k <= 8 for k in got.stats.k_per_loop)
