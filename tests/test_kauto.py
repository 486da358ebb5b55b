"""k="auto": K chosen before each loop from the running acceptance and the cost model; exact by construction."""

from collections import defaultdict

import pytest
import torch
from conftest import tiny_llama
from test_exactness import Dist, pair, pvalue, sample_counts, target_sequences  # noqa: F401  (pair: fixture)

from sampling import autoregressive_generate, speculative_generate
from sampling.probs import SamplingConfig
from sampling.speculative import KChooser

CHEAP = {"c": 0.05, "v": {k: 1.0 + 0.02 * k for k in range(1, 9)}}


def test_chooser_follows_the_speed_up_model():
    t = tiny_llama()
    hi = KChooser(t, t, 2, 8, CHEAP, alpha_prior=0.9)
    lo = KChooser(t, t, 2, 8, {"c": 0.6, "v": CHEAP["v"]}, alpha_prior=0.2)
    rows = torch.arange(2)
    assert hi.choose(rows) >= 6 and lo.choose(rows) == 1
    for _ in range(20):  # a row that keeps rejecting everything pulls K down
        hi.update(rows, torch.zeros(2, dtype=torch.long), 4)
    assert hi.choose(rows) <= 2
    with pytest.raises(ValueError, match="alpha_prior"):
        KChooser(t, t, 1, 8, CHEAP, alpha_prior=1.5)


def test_auto_k_passes_chi_square(pair):  # noqa: F811
    target, draft = pair
    prompt, budget, setting = [1, 3], 3, (0.9, 0, 0.95)
    exact = target_sequences(Dist(target, SamplingConfig(*setting)), prompt, budget, None)
    g = torch.Generator().manual_seed(11)
    counts = defaultdict(int)
    for _ in range(2):
        c, stats = sample_counts(
            lambda ids: speculative_generate(target, draft, ids, max_new_tokens=budget, k="auto", cost=CHEAP,
                                             alpha_prior=0.7, temperature=setting[0], top_p=setting[2], generator=g),
            25_000, budget, prompt)
        for s, n in c.items():
            counts[s] += n
    assert len(set(stats.k_per_loop)) >= 1 and 0 < stats.alpha < 1
    assert pvalue(counts, exact) > 1e-3


def test_auto_k_greedy_equals_target_and_measures_its_own_costs():
    target = tiny_llama(vocab=40, layers=3, seed=0, logit_scale=4.0)
    draft = tiny_llama(vocab=40, layers=1, hidden=16, seed=1, logit_scale=4.0)
    ids = torch.randint(0, 40, (3, 5), generator=torch.Generator().manual_seed(0))
    want = autoregressive_generate(target, ids, max_new_tokens=20, temperature=0)
    got = speculative_generate(target, draft, ids, max_new_tokens=20, k="auto", temperature=0)  # cost measured
    assert [t.tolist() for t in got.tokens] == [t.tolist() for t in want.tokens]
    assert got.stats.k_per_loop and all(1 <= k <= 8 for k in got.stats.k_per_loop)
