"""The statistics that judge samplers and engines: Pearson chi-square against exact probabilities (small cells
pooled), its power against a stated alternative, and the two-sample test for when no exact reference exists."""

from __future__ import annotations

import numpy as np
from scipy import stats

LEVEL = 1e-3  # per test: a false alarm in one run of a few settings stays well under 1%
MIN_EXPECTED = 5  # cells with fewer expected draws are pooled (the chi-square approximation needs ~5)


def chi2_pvalue(counts, probs) -> float:
    """Pearson chi-square p-value of observed counts against exact probabilities. Cells with zero probability must
    be empty (a hit there is an exactness failure, p = 0); cells with small expected counts are pooled into one."""
    counts, probs = np.asarray(counts, dtype=np.float64), np.asarray(probs, dtype=np.float64)
    if counts[probs <= 0].sum() > 0:
        return 0.0
    obs, exp = _pooled(counts, probs / probs.sum() * counts.sum())
    if len(obs) < 2:
        return 1.0
    return float(stats.chisquare(obs, exp).pvalue)


def _pooled(counts, expected):
    big = expected >= MIN_EXPECTED
    rest = ~big & (expected > 0)
    obs = list(counts[big]) + ([counts[rest].sum()] if rest.any() else [])
    exp = list(expected[big]) + ([expected[rest].sum()] if rest.any() else [])
    return np.asarray(obs), np.asarray(exp)


def chi2_power(null, alt, n: int, level: float = LEVEL) -> float:
    """Power of `chi2_pvalue` at `level` with n draws when the draws follow `alt` instead of `null`
    (noncentral chi-square, noncentrality n * sum (alt - null)^2 / null over the pooled cells)."""
    null, alt = np.asarray(null, dtype=np.float64), np.asarray(alt, dtype=np.float64)
    keep = null > 0
    null, alt = null[keep], alt[keep]
    big = null * n >= MIN_EXPECTED
    if (~big).any():
        null = np.append(null[big], null[~big].sum())
        alt = np.append(alt[big], alt[~big].sum())
    dof = len(null) - 1
    if dof < 1:
        return 0.0
    lam = n * float(((alt - null) ** 2 / null).sum())
    return float(stats.ncx2.sf(stats.chi2.isf(level, dof), dof, lam))


def two_sample_pvalue(a: dict, b: dict) -> float:
    """Homogeneity chi-square of two samples' counts over the same cells (small cells pooled)."""
    keys = sorted(set(a) | set(b), key=str)
    ca, cb = np.array([a.get(k, 0) for k in keys], float), np.array([b.get(k, 0) for k in keys], float)
    big = (ca + cb) >= 2 * MIN_EXPECTED
    table = [list(ca[big]) + [ca[~big].sum()], list(cb[big]) + [cb[~big].sum()]]
    table = np.array(table)[:, np.array(table).sum(0) > 0]
    if table.shape[1] < 2:
        return 1.0
    return float(stats.chi2_contingency(table)[1])
