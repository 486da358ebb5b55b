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
(4 x 256 tokens, AVX2, fp32); 1.9-2.2 s and 1.3-1.5 s on an AMX Xeon in bf16.

On the target's own samples even the first visit needs no pass: the target computed these logits (and features)
when it sampled the corpus, and `generate_corpus` keeps them (`prefill`). Those blocks lack a teacher where the
target sampled nothing (a prompt's tokens, the seam between two samples), and features where it never ran (the
seam): `known` and `known_features` mark the positions that have them.
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
        self.known = None  # (rows, positions) bool once blocks are prefilled; None: every position of a filled block
        self.known_features = None  # the same for features
        self.hits = self.misses = 0

    def prefill(self, src: torch.Tensor, values: torch.Tensor, index: torch.Tensor, min_known: float = 0.5,
                feature_at: torch.Tensor | None = None, features: torch.Tensor | None = None) -> int:
        """Fill blocks from logits kept elsewhere (the target's, as it sampled the corpus). `src` (rows, >= positions)
        points each label position at a row of `values` / `index` (the top-k log-probabilities and their token ids,
        k >= this cache's, largest first), -1 where there is none; a cache that keeps features needs them as well
        (`feature_at` into `features`). A block with fewer than `min_known` of its positions pointed at is left to
        the teacher pass. Returns the number of blocks filled."""
        if values.shape[-1] < self.k or (self.features is not None and features is None):
            return 0
        P = self.values.shape[1]
        src = src[:, :P]
        have = src >= 0
        ok = have.float().mean(1) >= min_known
        if self.features is not None:
            feature_at = feature_at[:, :P]
            fhave = feature_at >= 0
            ok &= fhave.float().mean(1) >= min_known
            fsel = fhave & ok[:, None]
            self.features[fsel] = features[feature_at[fsel]]
            if self.known_features is None:
                self.known_features = self.filled[:, None].expand_as(fhave).clone()
            self.known_features[ok] = fhave[ok]
        sel = have & ok[:, None]
        at = src[sel]
        top = values[at, : self.k]
        self.values[sel], self.index[sel] = top, index[at, : self.k]
        self.fill[sel] = _tail_fill(top, self.vocab, self.k)
        if self.known is None:
            self.known = self.filled[:, None].expand_as(have).clone()
        self.known[ok] = have[ok]
        self.filled |= ok
        return int(ok.sum())

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
            self.features[rows] = half_features(features)
        top, idx = top_logprobs(logits.detach().cpu(), self.k)
        self.values[rows], self.index[rows] = top, idx
        self.fill[rows] = _tail_fill(top, self.vocab, self.k)
        self.filled[rows] = True
        if self.known is not None:
            self.known[rows] = True
        if self.known_features is not None:
            self.known_features[rows] = True

    def known_rows(self, rows: torch.Tensor) -> torch.Tensor | None:
        """(B, positions) bool: the label positions of blocks `rows` that have a teacher; None when all have."""
        return None if self.known is None else self.known[rows.cpu()]

    def known_feature_rows(self, rows: torch.Tensor) -> torch.Tensor | None:
        """(B, positions) bool: the positions of blocks `rows` that have the target's features; None when all have."""
        return None if self.known_features is None else self.known_features[rows.cpu()]

    @property
    def hit_rate(self) -> float:
        return self.hits / max(1, self.hits + self.misses)


def half_features(features: torch.Tensor) -> torch.Tensor:
    """The target's hidden states as kept: fp16 on the CPU, refused (one line) where they exceed its range."""
    half = features.detach().cpu().half()
    if not bool(torch.isfinite(half).all()):
        raise ValueError("the target's features exceed float16's range (65504), so they cannot be kept: set "
                         "loss.teacher_topk=0")
    return half


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest log-probabilities (fp16: finest near 0, where the mass is) and their token ids (int32): what
    is kept of a position's logits. What is stored is what every visit uses, the first included."""
    top, idx = torch.log_softmax(logits.float(), -1).topk(k, dim=-1)
    return top.half(), idx.int()


def _tail_fill(top: torch.Tensor, vocab: int, k: int) -> torch.Tensor:
    """The log-probability each of the V - k tokens not kept gets: their exact mass at T 1, spread evenly."""
    rest = (1.0 - top.float().exp().sum(-1)).clamp_min(1e-12)
    return torch.log(rest) - math.log(vocab - k)
