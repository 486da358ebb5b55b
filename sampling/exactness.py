"""The statistics that judge samplers and engines: Pearson chi-square against exact probabilities (small cells
pooled), its power against a stated alternative, the two-sample test for when no exact reference exists, and the
exact distribution of a prompt's first two sampled tokens as chi-square cells (`pair_cells`): what `deploy_check`
judges an engine's speculative decoding on, and the trainer an engine's plain sampling before it keeps a sample."""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
from scipy import stats

from draftsmith.sampling.errors import DraftsmithError
from draftsmith.sampling.machine import device_of
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


# another implementation's rounding is another draw of the same noise, larger or smaller than our forward's: an
# engine may deviate from exact up to twice as much as ours (its calibration: docs/results.md, the engine check)
NOISE_MARGIN = 2


def noisy_pvalue(counts, probs, lo, hi, resolved, divergence: float) -> float:
    """Chi-square p-value of observed counts against exact probabilities that an engine computing in a rounding
    precision (bf16, fp16) samples only approximately. `resolved` cells (big enough to resolve: the frequent pairs)
    count as Pearson's terms, and the statistic is judged against a noncentral chi-square whose noncentrality is
    NOISE_MARGIN x draws x `divergence`, the chi-square divergence from exact of our own forward in that precision:
    the deviation the precision itself makes is allowed, twice over, no more. The other cells (a frequent first
    token's rest, the rare first tokens: where the top-p edge moves with the rounding) are known only to lie in
    [lo, hi], and count only beyond that band, over its top (never more than Pearson's against any probability in
    it). A hit where hi is 0 is an exactness failure (p = 0); small cells are pooled into one."""
    counts, probs, lo, hi = (np.asarray(x, dtype=np.float64) for x in (counts, probs, lo, hi))
    resolved = np.asarray(resolved, dtype=bool)
    if counts[hi <= 0].sum() > 0:
        return 0.0
    n = counts.sum()
    exact = resolved & (probs * n >= MIN_EXPECTED)
    banded = ~exact & (hi * n >= MIN_EXPECTED)
    pooled = ~exact & ~banded & (hi > 0)
    stat = float(((counts[exact] - n * probs[exact]) ** 2 / (n * probs[exact])).sum())
    obs, low, high = counts[banded], lo[banded], hi[banded]
    if pooled.any():
        obs, low, high = (np.append(a, b[pooled].sum()) for a, b in ((obs, counts), (low, lo), (high, hi)))
    stat += float(((obs - np.clip(obs, n * low, n * np.minimum(high, 1.0))) ** 2 / (n * high)).sum())
    dof = int(exact.sum()) + len(obs) - 1
    if dof < 1:
        return 1.0
    return float(stats.ncx2.sf(stat, dof, NOISE_MARGIN * n * divergence) if divergence > 0 else
                 stats.chi2.sf(stat, dof))


@dataclass
class PairCells:
    """The exact distribution of a prompt's first two sampled tokens, as chi-square cells: (t1, t2) where its
    expected count is big enough, (t1, REST) for the rest of a frequent t1, (REST,) for rare first tokens.
    With `noise` > 0 (a target held in bf16 or fp16, `pair_cells`) the engine is allowed that precision's own
    deviation: `divergence` over the frequent pairs, [lo, hi] in the other cells, and a token is impossible only
    where no distribution within the noise samples it (`noisy_pvalue`)."""

    probs: dict
    q1: torch.Tensor  # (V,) float64
    q2: dict = field(default_factory=dict)  # frequent t1 -> (V,) float64
    eos: frozenset = frozenset()
    noise: float = 0.0  # the largest log-probability change the target's own precision makes (0: fp32, exact)
    divergence: float = 0.0  # the chi-square divergence of that precision's pair cells from the exact ones
    lo: dict | None = None  # cell -> lowest probability within the noise (None: probs)
    hi: dict | None = None
    possible1: torch.Tensor | None = None  # (V,) bool: first tokens some distribution within the noise samples
    possible2: dict | None = None  # frequent t1 -> (V,) bool

    REST = "rest"
    IMPOSSIBLE = "impossible"

    def cell(self, sample: list[int]):
        t1 = sample[0]
        if not (self.q1[t1] > 0 if self.possible1 is None else self.possible1[t1]):
            return (self.IMPOSSIBLE,)
        if t1 not in self.q2:
            return (self.REST,)
        if len(sample) < 2:
            raise DraftsmithError(f"the engine stopped after token {t1}, which is not an EOS, with 2 tokens asked")
        t2 = sample[1]
        if not (self.q2[t1][t2] > 0 if self.possible2 is None else self.possible2[t1][t2]):
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
        if self.lo is None:
            return chi2_pvalue([counts.get(k, 0) for k in keys], [self.probs.get(k, 0.0) for k in keys])
        return noisy_pvalue([counts.get(k, 0) for k in keys], [self.probs.get(k, 0.0) for k in keys],
                            [self.lo.get(k, 0.0) for k in keys], [self.hi.get(k, 0.0) for k in keys],
                            [k[-1] not in (self.REST, self.IMPOSSIBLE) for k in keys], self.divergence)


@contextmanager
def fp32_arithmetic(model):
    """Run `model` in fp32 arithmetic on its own weights, whatever their dtype: each module's weights are upcast on
    their device while it runs and put back after (bf16 -> fp32 -> bf16 is exact), so at most one module's weights
    exist in fp32 at a time, never a copy of the whole model (282 GB for a 70B target)."""
    low = (torch.bfloat16, torch.float16)
    owners = [m for m in model.modules()
              if any(t.dtype in low for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)))]
    if not owners:
        yield model
        return

    def up(module, *_):
        module._fp32_saved = [(t, t.dtype) for t in (*module.parameters(recurse=False), *module.buffers(recurse=False))
                              if t.dtype in low]
        for t, _ in module._fp32_saved:
            t.data = t.data.float()

    def down(module, *_):
        for t, dtype in module.__dict__.pop("_fp32_saved", []):
            t.data = t.data.to(dtype)

    hooks = [h for m in owners for h in (m.register_forward_pre_hook(up), m.register_forward_hook(down))]
    try:
        yield model
    finally:
        for h in hooks:
            h.remove()
        for m in owners:  # a forward that raised midway: its module's weights back in their dtype
            down(m)


def _last_logits(target, x: torch.Tensor, chunk: int):
    """(rows, V) last-position logits of `x` on the CPU in fp32: from fp32 arithmetic on the target's weights, and
    (None for an fp32 target) from the target's own precision; `chunk` rows a pass, on the target's device."""
    exact, own = [], []
    lowp = any(p.dtype in (torch.bfloat16, torch.float16) for p in target.parameters())
    for part in x.to(device_of(target)).split(chunk):
        with fp32_arithmetic(target):
            exact.append(target(part).logits[:, -1].float().cpu())
        if lowp:
            own.append(target(part).logits[:, -1].float().cpu())
    return torch.cat(exact), (torch.cat(own) if lowp else None)


def _noise(exact: torch.Tensor, own, cfg: SamplingConfig) -> float:
    """The largest change of a sampleable token's log-probability (at the sampling temperature) that the target's
    own precision makes at these positions; 0 for fp32."""
    if own is None:
        return 0.0
    t = cfg.temperature if cfg.temperature > 0 else 1.0
    a, b = torch.log_softmax(exact.double() / t, -1), torch.log_softmax(own.double() / t, -1)
    live = (process_logits(exact, cfg) > 0) | (process_logits(own, cfg) > 0)
    return float((a - b).abs()[live].max())


def _band(logits: torch.Tensor, cfg: SamplingConfig, eps: float):
    """(lo, hi, possible): per token, the lowest and highest probability a sampler can give it when every
    log-probability may be off by up to `eps` (the probabilities still summing to 1), with the temperature, top-p
    and the nucleus' renormalisation applied as `process_logits` applies them; float64 on the CPU."""
    q = process_logits(logits, cfg).double()
    if eps == 0:
        return q, q, q > 0
    if cfg.greedy:  # the argmax may move to any token whose logit is within 2 eps of the top one
        possible = logits.double() >= logits.double().max() - 2 * eps
        return (q if int(possible.sum()) == 1 else torch.zeros_like(q)), possible.double(), possible
    if 0 < cfg.top_k < logits.shape[-1]:
        raise DraftsmithError("a precision tolerance with top-k is not derived here; judge top-k sampling in fp32")
    p = torch.softmax(logits.double() / cfg.temperature, -1)
    up, down = math.exp(eps), math.exp(-eps)
    if cfg.top_p >= 1.0:
        return p * down, (p * up).clamp(max=1.0), p > 0
    # a token is in the nucleus iff the mass ranked above it is below top_p: bound that mass for each token from
    # the tokens surely above it (p_i e^-eps > p_j e^eps) and surely below it, given that the total stays 1
    s = p.sort(descending=True).values
    asc = s.flip(0)
    total = torch.cat([torch.zeros(1, dtype=s.dtype), s.cumsum(0)])  # total[k]: mass of the k largest
    n = len(s)

    def above(threshold, strict: bool):  # mass of tokens with p_i > threshold (>= when not strict)
        k = n - torch.searchsorted(asc, threshold, right=strict)
        return total[k]

    surely_above = above(p * up * up, strict=True)
    maybe_above = above(p * down * down, strict=False) - p  # every token that may rank above j, j itself not
    min_before = torch.maximum(down * surely_above, 1 - up * (1 - surely_above))
    max_before = torch.minimum(up * maybe_above, 1 - down * (1 - maybe_above))
    possible = (min_before < cfg.top_p) & (p > 0)
    sure = max_before < cfg.top_p
    # the nucleus' own mass (its renormaliser) lies in [top_p, 1]
    lo = torch.where(sure, p * down, torch.zeros_like(p))
    hi = torch.where(possible, (p * up / cfg.top_p).clamp(max=1.0), torch.zeros_like(p))
    return lo, hi, possible


@torch.inference_mode()
def pair_cells(target, prompt: list[int], cfg: SamplingConfig, draws: int, eos, chunk: int = 64) -> PairCells:
    """The cells of `prompt`'s first two sampled tokens under the target as an engine holds it: its own weights in
    their own dtype (the engine's), the probabilities from fp32 arithmetic on them, computed on the target's device
    `chunk` rows a pass (the frequent first tokens' continuations), with no fp32 copy of the target.

    Like with like: an engine running a bf16 target also rounds every activation to bf16, and that moves the
    distribution it samples by more than 2000 draws resolve. Our own forward in bf16 is no reference for it: two
    bf16 implementations round differently (measured on the demo target: vLLM's bf16 samples fail against our bf16
    forward at p 0; against fp32 arithmetic they fail only at the top-p edge, where a token just outside the
    nucleus comes in, and by a deviation about the size our own bf16 forward makes). So the reference is exact, and
    the precision's own noise is measured on these same positions from our forward in the target's dtype: `noise`,
    the largest log-probability change of any token it may sample (which tokens an engine in that precision may
    sample at the nucleus' edge, and the [lo, hi] of the cells that hold them), and `divergence`, the chi-square
    divergence of its frequent pairs from the exact ones (the deviation the test allows there, `noisy_pvalue`).
    An fp32 target has no such noise: its cells are exact and its test Pearson's, as they always were.
    """
    ids = torch.tensor([prompt])
    exact, own = _last_logits(target, ids, chunk)
    q1 = process_logits(exact[0], cfg).double()
    eos = frozenset(eos if isinstance(eos, (list, tuple)) else [eos])
    frequent = [t for t in (q1 * draws >= MIN_EXPECTED).nonzero().flatten().tolist() if t not in eos]
    rows_exact = rows_own = None
    if frequent:
        x = torch.cat([ids.expand(len(frequent), -1), torch.tensor(frequent)[:, None]], 1)
        rows_exact, rows_own = _last_logits(target, x, chunk)
    eps = max(_noise(exact, own, cfg), _noise(rows_exact, rows_own, cfg) if frequent else 0.0)
    probs, q2 = {}, {}
    lo1, hi1, possible1 = _band(exact[0], cfg, eps)
    lo, hi, possible2, divergence = {}, {}, {}, 0.0
    own1 = process_logits(own[0], cfg).double() if eps else None
    for i, t1 in enumerate(frequent):
        row = process_logits(rows_exact[i], cfg).double()
        q2[t1] = row
        joint = row * q1[t1]
        big = (joint * draws >= MIN_EXPECTED).nonzero().flatten().tolist()
        for t2 in big:
            probs[(t1, t2)] = float(joint[t2])
        probs[(t1, PairCells.REST)] = max(0.0, float(q1[t1]) - sum(float(joint[t2]) for t2 in big))
        if eps:
            own_joint = process_logits(rows_own[i], cfg).double() * own1[t1]
            divergence += float(((own_joint[big] - joint[big]) ** 2 / joint[big]).sum())
            lo2, hi2, possible2[t1] = _band(rows_exact[i], cfg, eps)
            others = torch.ones_like(lo2, dtype=torch.bool)
            others[big] = False
            for t2 in big:
                lo[(t1, t2)], hi[(t1, t2)] = float(lo1[t1] * lo2[t2]), float(hi1[t1] * hi2[t2])
            lo[(t1, PairCells.REST)] = float(lo1[t1] * max(float(lo2[others].sum()), 1 - float(hi2[big].sum())))
            hi[(t1, PairCells.REST)] = float(hi1[t1] * min(float(hi2[others].sum()), 1 - float(lo2[big].sum())))
    probs[(PairCells.REST,)] = max(0.0, 1.0 - float(q1[frequent].sum()) if frequent else 1.0)
    if not eps:
        return PairCells(probs, q1, q2, eos)
    rare = torch.ones_like(lo1, dtype=torch.bool)
    rare[frequent] = False
    lo[(PairCells.REST,)] = max(float(lo1[rare].sum()), 1 - float(hi1[frequent].sum()), 0.0)
    hi[(PairCells.REST,)] = min(float(hi1[rare].sum()), 1 - float(lo1[frequent].sum()))
    return PairCells(probs, q1, q2, eos, eps, divergence, lo, hi, possible1, possible2)
