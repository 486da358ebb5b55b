"""Statistics of one generation call, named as in docs/design.md."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

# the label `tokens_per_call` is shown under wherever figures are compared with peers' (SpecForge, speculators, vLLM,
# SGLang call it acceptance length, tau); the key stays `tokens_per_call`
TAU = "acceptance length tau"


def summary(xs) -> dict:
    """mean, std, P50, P90, P99 of a list of latencies ({} when empty)."""
    import numpy as np

    a = np.asarray(xs, dtype=float)
    if not len(a):
        return {}
    return {"mean": float(a.mean()), "std": float(a.std()), "p50": float(np.percentile(a, 50)),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99))}


@dataclass
class GenerationStats:
    """Counters of a generate call; the derived rates are properties so they can never disagree.

    alpha counts a draft token as proposed when it reaches the acceptance test (tokens after a
    rejection in the same loop are discarded untested). That makes alpha the estimate of the per-token
    acceptance probability that the speed-up model (1 - alpha^(K+1)) / ((1 - alpha)(K c + v(K))) uses.
    """

    k: int = 0
    rows: int = 0
    new_tokens: int = 0  # tokens emitted over all rows
    target_calls: int = 0  # target forward passes after the prompt, summed over loops (one per loop)
    draft_calls: int = 0  # draft forward passes after the prompt
    drafted: int = 0  # draft tokens that reached the acceptance test (summed over rows)
    accepted: int = 0
    alpha_analytic_sum: float = 0.0  # sum over tested positions of sum_x min(p, q)
    row_loops: int = 0  # loops summed over rows (each row's target pass counts once)
    accepted_at: list[int] = field(default_factory=list)  # per draft position i: accepted there
    tested_at: list[int] = field(default_factory=list)  # per draft position i: reached the test there
    draft_s: float = 0.0
    target_s: float = 0.0
    total_s: float = 0.0
    prefill_s: float = 0.0
    loop_end_s: list[float] = field(default_factory=list)  # time at the end of each loop (seconds from the start)
    loop_tokens: list[int] = field(default_factory=list)  # tokens emitted in that loop (all rows)
    k_per_loop: list[int] = field(default_factory=list)  # k="auto": the K chosen before each loop

    def record_loop(self, tokens: int, mark: int) -> None:
        """A loop ended at `mark` (a `machine.Timeline` mark, resolved into seconds by `finish`)."""
        self.loop_end_s.append(mark)
        self.loop_tokens.append(tokens)

    def finish(self, timeline, alpha_analytic_sum=None) -> None:
        """The times of `timeline`'s spans (`prefill`, `draft`, `target`) and loop ends, read once at the end of a
        generation; `alpha_analytic_sum`, a device tensor summed over the loops, read then too."""
        timeline.mark()  # the end of the generation
        at = timeline.seconds()
        self.prefill_s = timeline.total("prefill", at)
        self.draft_s = timeline.total("draft", at)
        self.target_s = timeline.total("target", at)
        self.total_s = at[-1]
        self.loop_end_s = [at[m] for m in self.loop_end_s]
        if alpha_analytic_sum is not None:
            self.alpha_analytic_sum = float(alpha_analytic_sum)

    def token_latencies_ms(self) -> list[float]:
        """Per emitted token: the wall time of the loop that emitted it divided by that loop's tokens (tokens of
        one loop arrive together). The first loop's clock starts after the prefill."""
        out = []
        for i in range(1, len(self.loop_end_s)):
            n = self.loop_tokens[i]
            if n:
                out += [1e3 * (self.loop_end_s[i] - self.loop_end_s[i - 1]) / n] * n
        return out

    def record_row(self, n_accepted: int, k: int) -> None:
        """One row's verification: its first n_accepted of k drafts accepted, the next one (if any) rejected."""
        tested = min(n_accepted + 1, k)
        while len(self.tested_at) < k:
            self.tested_at.append(0)
            self.accepted_at.append(0)
        for i in range(tested):
            self.tested_at[i] += 1
        for i in range(n_accepted):
            self.accepted_at[i] += 1
        self.drafted += tested
        self.accepted += n_accepted
        self.row_loops += 1

    @property
    def alpha(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def alpha_analytic(self) -> float | None:
        return self.alpha_analytic_sum / self.drafted if self.drafted else None

    @property
    def tokens_per_call(self) -> float | None:
        """Tokens emitted per target pass per row, bonus token included; in [1, K+1]."""
        return self.new_tokens / self.row_loops if self.row_loops else None

    @property
    def acceptance_efficiency(self) -> float | None:
        """Mean tokens emitted per loop / (K+1), the middle panel of the paper's Figure 1."""
        tpc = self.tokens_per_call
        return tpc / (self.k + 1) if tpc is not None and self.k else None

    @property
    def acceptance_by_position(self) -> list[float | None]:
        return [a / t if t else None for a, t in zip(self.accepted_at, self.tested_at)]

    @property
    def overhead_s(self) -> float:
        return max(0.0, self.total_s - self.draft_s - self.target_s - self.prefill_s)

    @property
    def ms_per_token(self) -> float | None:
        """Wall time per emitted token of one row (decode only, prefill excluded)."""
        per_row = self.new_tokens / max(self.rows, 1)
        return 1e3 * (self.total_s - self.prefill_s) / per_row if per_row else None

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("loop_end_s")
        d.pop("loop_tokens")
        for name in ("alpha", "alpha_analytic", "tokens_per_call", "acceptance_efficiency",
                     "acceptance_by_position", "overhead_s", "ms_per_token"):
            d[name] = getattr(self, name)
        return d
