"""The statistics that judge samplers and engines: Pearson chi-square against exact probabilities (small cells
pooled), its power against a stated alternative, the two-sample test for when no exact reference exists, and the
exact distribution of a prompt's first two sampled tokens as chi-square cells (`pair_cells`): what `deploy_check`
judges an engine's speculative decoding on, and the trainer an engine's plain sampling before it keeps a sample."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from scipy import stats

from draftsmith.sampling.probs import SamplingConfig, process_logits

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


CHI_PROMPT = "def "


@dataclass
class PairCells:
    """The exact distribution of a prompt's first two sampled tokens, as chi-square cells: (t1, t2) where its
    expected count is big enough, (t1, REST) for the rest of a frequent t1, (REST,) for rare first tokens."""

    probs: dict
    q1: torch.Tensor  # (V,) float64
    q2: dict = field(default_factory=dict)  # frequent t1 -> (V,) float64
    eos: frozenset = frozenset()

    REST = "rest"
    IMPOSSIBLE = "impossible"

    def cell(self, sample: list[int]):
        t1 = sample[0]
        if self.q1[t1] <= 0:
            return (self.IMPOSSIBLE,)
        if t1 not in self.q2:
            return (self.REST,)
        if len(sample) < 2:
            raise ValueError(f"the engine stopped after token {t1}, which is not an EOS, with 2 tokens asked")
        t2 = sample[1]
        if self.q2[t1][t2] <= 0:
            return (self.IMPOSSIBLE,)
        return (t1, t2) if (t1, t2) in self.probs else (t1, self.REST)

    def counts(self, samples) -> dict:
        out: dict = {}
        for s in samples:
            c = self.cell(s)
            out[c] = out.get(c, 0) + 1
        return out

    def pvalue(self, counts: dict) -> float:
        keys = list(self.probs) + [(self.IMPOSSIBLE,)]
        return chi2_pvalue([counts.get(k, 0) for k in keys], [self.probs.get(k, 0.0) for k in keys])


@torch.inference_mode()
def pair_cells(target, prompt: list[int], cfg: SamplingConfig, draws: int, eos) -> PairCells:
    ids = torch.tensor([prompt])
    q1 = process_logits(target(ids).logits[0, -1], cfg).double()
    eos = frozenset(eos if isinstance(eos, (list, tuple)) else [eos])
    frequent = [t for t in (q1 * draws >= MIN_EXPECTED).nonzero().flatten().tolist() if t not in eos]
    probs, q2 = {}, {}
    if frequent:
        x = torch.cat([ids.expand(len(frequent), -1), torch.tensor(frequent)[:, None]], 1)
        rows = process_logits(target(x).logits[:, -1], cfg).double()
        for t1, row in zip(frequent, rows):
            q2[t1] = row
            joint = row * q1[t1]
            big = (joint * draws >= MIN_EXPECTED).nonzero().flatten().tolist()
            for t2 in big:
                probs[(t1, t2)] = float(joint[t2])
            probs[(t1, PairCells.REST)] = max(0.0, float(q1[t1]) - sum(float(joint[t2]) for t2 in big))
    probs[(PairCells.REST,)] = max(0.0, 1.0 - float(q1[frequent].sum()) if frequent else 1.0)
    return PairCells(probs, q1, q2, eos)
