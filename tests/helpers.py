"""Shared statistical helpers for the exactness tests."""

import numpy as np
from scipy.stats import chisquare


def chi2_pvalue(counts, probs) -> float:
    """Pearson chi-square p-value of observed counts against exact probabilities.

    Cells with zero probability must be empty (any hit there is an exactness failure, p = 0); cells with
    small expected counts are pooled into one so the chi-square approximation holds.
    """
    counts = np.asarray(counts, dtype=np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    if counts[probs <= 0].sum() > 0:
        return 0.0
    n = counts.sum()
    expected = probs / probs.sum() * n
    big = expected >= 5
    obs = list(counts[big]) + ([counts[~big].sum()] if (~big).any() else [])
    exp = list(expected[big]) + ([expected[~big].sum()] if (~big).any() else [])
    if len(obs) < 2:
        return 1.0
    return float(chisquare(obs, exp).pvalue)
