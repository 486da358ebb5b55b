"""k="auto": how many tokens to draft, decided token by token from the draft's side and the measured costs, so that
the output stays exact (the decision never reads the target's verdict on the tokens it is about to test). The
speculative loop (`speculative.py`) asks `KChooser.stopper` after each drafted token and reports each loop's
outcome to `KChooser.update`."""

from __future__ import annotations

import torch

from draftsmith.sampling.errors import DraftsmithError
from draftsmith.sampling.machine import device_of

_COSTS: dict = {}  # (id(target), id(draft), compile) -> measured cost model, for k="auto" without a given one


def _interpolate(v: dict, k: int) -> float:
    """v(K) at a K the cost model did not measure (a bench sweep of 1, 2, 4 leaves out 3): linear between its
    neighbours, v(0) = 1 (a plain target step)."""
    if k in v or k == 0:
        return v.get(k, 1.0)
    lo, hi = max((j for j in v if j < k), default=None), min((j for j in v if j > k), default=None)
    if lo is None or hi is None:
        return v[hi if lo is None else lo]
    return v[lo] + (k - lo) / (hi - lo) * (v[hi] - v[lo])


class KChooser:
    """K per loop (k="auto"), decided token by token from the draft's side, so the output stays exact.

    After each drafted token the draft stops where the speed-up model of docs/design.md says stopping now gives the most
    expected tokens per unit of time, sum_rows E_r(K) / (K c + v(K)), against drafting on to any K up to `k_max`.
    E_r(K) = 1 + sum_{j<=K} prod_{l<=j} a_rl: the tokens drafted so far each carry an acceptance predicted from the
    draft's probability of them (a table over `BINS` bins of that probability, fitted online to min(1, q/p) at
    every drafted position: a token the draft was unsure of is rejected more often); tokens not yet drafted carry
    the row's posterior mean acceptance (a Beta prior of weight `strength` tokens at `alpha_prior`, updated with
    the row's tested and accepted drafts). Before any observation both are `alpha_prior`, and the first loop's K is
    the fixed K the speed-up model would pick at that alpha."""

    BINS = 10

    def __init__(self, target, draft, rows: int, k_max: int, cost: dict | None, alpha_prior: float,
                 strength: float = 8.0, compile: bool = False):
        if not isinstance(k_max, int) or k_max < 1:
            raise DraftsmithError(f"k_max must be an integer >= 1, got {k_max}")
        if not 0.0 <= alpha_prior < 1.0:
            raise DraftsmithError(f"alpha_prior must be in [0, 1), got {alpha_prior}")
        if cost is None:
            key = (id(target), id(draft), compile)
            if key not in _COSTS:
                from draftsmith.sampling.cost import measure_costs

                _COSTS[key] = measure_costs(target, draft, ks=range(1, k_max + 1), reps=5, compile=compile)
            cost = _COSTS[key]
        v = {int(kk): float(x) for kk, x in cost["v"].items() if int(kk) <= k_max}
        if not v:
            raise DraftsmithError(f"the cost model has no v(K) for K in 1..{k_max}")
        self.k_max = max(v)
        # the state lives where the models do: a decision reads one value back, never the tables
        dev = device_of(target)
        f64 = dict(dtype=torch.float64, device=dev)
        self.time = torch.tensor([k * float(cost["c"]) + _interpolate(v, k) for k in range(self.k_max + 1)],
                                 **f64)  # index K; K = 0 is never chosen (a loop drafts >= 1)
        self.accepted = torch.full((rows,), alpha_prior * strength, **f64)
        self.tested = torch.full((rows,), strength, **f64)
        self.bin_accept = torch.full((self.BINS,), alpha_prior, **f64)  # one pseudo-token per bin
        self.bin_count = torch.ones(self.BINS, **f64)

    def _bins(self, conf: torch.Tensor) -> torch.Tensor:
        return (conf * self.BINS).long().clamp_(0, self.BINS - 1)

    def stopper(self, active: torch.Tensor, bound: int):
        """The `stop(confs)` of one loop over the `active` rows (on the device), drafting at most `bound` tokens:
        computed where the models are, one boolean read back per drafted token."""
        a = (self.accepted[active] / self.tested[active]).clamp(max=1 - 1e-6)[:, None]  # (B, 1)
        table = self.bin_accept / self.bin_count

        def stop(confs: list[torch.Tensor]) -> bool:
            i = len(confs)
            pred = table[self._bins(torch.stack(confs, 1))]  # (B, i)
            prefix = pred.cumprod(1)
            more = (a ** torch.arange(1, bound - i + 1, dtype=torch.float64, device=a.device)).cumsum(1)
            expected = 1 + prefix.sum(1, keepdim=True) + prefix[:, -1:] * torch.cat([torch.zeros_like(a), more], 1)
            return bool((expected.sum(0) / self.time[i:bound + 1]).argmax() == 0)

        return stop

    def update(self, active: torch.Tensor, n: torch.Tensor, K: int, confs: torch.Tensor, accept: torch.Tensor):
        """n (B,) drafts accepted of K; confs, accept (B, K): the draft's probability of each drafted token and the
        probability the target accepts it, min(1, q/p) (greedy: whether it matched). All on the device."""
        n = n.double()
        self.accepted[active] += n
        self.tested[active] += torch.clamp(n + 1, max=K)  # drafts that reached the test
        bins = self._bins(confs).flatten()
        self.bin_accept.index_add_(0, bins, accept.double().flatten())
        self.bin_count.index_add_(0, bins, torch.ones_like(bins, dtype=torch.float64))
