"""The frozen target's logits on each training block, kept after the block's first visit.

A draft sees every block of its corpus several times (the default recipe: about ten epochs), and the frozen
target gives the same logits each time. Its teacher pass is 59% of a default training step on our 2-core CPU
(2.37 of 4.0 s for 4 x 256 tokens, AVX2, fp32), so it is paid once per block and its top-k logits are kept.

What is kept per position: the k largest log-probabilities (fp16, whose precision is finest near 0, where the mass
is) and their token ids, plus one value for the other V - k tokens that gives them the target's exact tail mass
at temperature 1, spread evenly. Every divergence stays finite (a -inf tail would make reverse KL infinite), and
at k = 128 the kept entries hold 99.2% of the target's mass at T 0.8 (mean over its own samples; 98.5% at k = 64),
so its nucleus (top-p 0.95) is whole at 96% of positions. A first visit and a later one see the same stored
logits (a resumed run's empty cache refills with the same numbers), so the loss curve does not depend on which
visit it is.

A feature draft (EAGLE-3) also reads the target's hidden states at three layers: with `features` they are kept
too (fp16; 3 x 576 values a position for the demo target, whose largest is ~25k), so its later epochs run without
the target as well (EAGLE's offline mode): a feature step measured 5.3 s with the target's pass, 2.9 s without
(4 x 256 tokens, AVX2, fp32).
"""

from __future__ import annotations

import math

import torch


class TeacherCache:
    """Top-k target logits for `rows` blocks of `positions` label positions each, filled on first use. With
    `columns` (a pruned draft head's tokens) it hands out only those tokens' logits, in that order; with
    `features` > 0 it keeps that many feature values a position as well."""

    def __init__(self, rows: int, positions: int, k: int, vocab: int, columns: torch.Tensor | None = None,
                 features: int = 0):
        if not 0 < k < vocab:
            raise ValueError(f"loss.teacher_topk must be in [1, {vocab}) (the target's vocabulary), got {k}")
        self.k, self.vocab = k, vocab
        self.width = vocab if columns is None else len(columns)
        # where each kept token lands: its column, or a spare last one (dropped) when the head lacks it
        self.column_of = None if columns is None else torch.full((vocab,), self.width, dtype=torch.long)
        if columns is not None:
            self.column_of[columns.cpu()] = torch.arange(self.width)
        self.values = torch.zeros(rows, positions, k, dtype=torch.float16)
        self.index = torch.zeros(rows, positions, k, dtype=torch.int32)
        self.fill = torch.zeros(rows, positions, dtype=torch.float32)
        self.features = torch.zeros(rows, positions, features, dtype=torch.float16) if features else None
        self.filled = torch.zeros(rows, dtype=torch.bool)
        self.hits = self.misses = 0

    def logits(self, rows: torch.Tensor, teacher) -> torch.Tensor:
        """(B, positions, V or N columns) float32 logits (log-probabilities) of the blocks `rows`; `teacher(mask)`
        gives the target's logits (m, positions, V) of the batch rows `mask` selects, called for unseen blocks only."""
        return self.outputs(rows, lambda miss: (teacher(miss), None))[0]

    def outputs(self, rows: torch.Tensor, teacher) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits as `logits` gives them, float32 features (B, positions, F) or None); `teacher(mask)` gives the
        target's (logits, features) of the batch rows `mask` selects, called for unseen blocks only."""
        rows = rows.cpu()
        miss = ~self.filled[rows]
        if miss.any():
            self._store(rows[miss], *teacher(miss.to(torch.bool)))
        self.misses += int(miss.sum())
        self.hits += len(rows) - int(miss.sum())
        vals, idx, fill = self.values[rows].float(), self.index[rows].long(), self.fill[rows]
        spare = self.column_of is not None
        if spare:
            idx = self.column_of[idx]
        out = fill.unsqueeze(-1).expand(*fill.shape, self.width + spare).clone()
        feats = None if self.features is None else self.features[rows].float()
        return out.scatter_(-1, idx, vals)[..., : self.width], feats

    def _store(self, rows: torch.Tensor, logits: torch.Tensor, features: torch.Tensor | None = None) -> None:
        if self.features is not None:
            half = features.detach().cpu().half()
            if not bool(torch.isfinite(half).all()):
                raise ValueError("the target's features exceed float16's range (65504), so they cannot be kept: "
                                 "set loss.teacher_topk=0")
            self.features[rows] = half
        logp = torch.log_softmax(logits.detach().float().cpu(), -1)  # in fp16 near 0, where the mass is
        top, idx = logp.topk(self.k, dim=-1)
        top = top.half()  # what is stored is what every visit uses, the first included
        rest = (1.0 - top.float().exp().sum(-1)).clamp_min(1e-12)  # the tail's mass at T 1, over its V - k tokens
        self.values[rows], self.index[rows] = top, idx.int()
        self.fill[rows] = torch.log(rest) - math.log(self.vocab - self.k)
        self.filled[rows] = True

    @property
    def hit_rate(self) -> float:
        return self.hits / max(1, self.hits + self.misses)
