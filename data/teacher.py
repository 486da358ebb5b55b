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
the target as well (EAGLE's offline mode): 1.3-1.5 s a feature step against 1.9-2.2 s with its pass (docs/results.md,
"The feature head").

On the target's own samples even the first visit needs no pass: the target computed these logits (and features)
when it sampled the corpus, and `generate_corpus` keeps them (`prefill`). Those blocks lack a teacher where the
target sampled nothing (a prompt's tokens, the seam between two samples), and features where it never ran (the
seam): `known` and `known_features` mark the positions that have them.
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

import torch

from draftsmith.data.diskfull import disk_full
from draftsmith.sampling.errors import DraftsmithError


class TeacherCache:
    """Top-k target logits for `rows` blocks of `positions` label positions each, filled on first use. With
    `columns` (a pruned draft head's tokens) it hands out only those tokens' logits, in that order; with
    `features` > 0 it keeps that many feature values a position as well.

    The kept values live in a file, one fixed-size record per block, read with `pread` per batch: a training
    rank's memory does not grow with the corpus (at Llama-8B the features alone are ~24 KB a position). The file
    is anonymous (unlinked at once) in `directory` (the run's directory; the system's temporary one by default) and
    sparse: a block never filled takes no disk. Only the per-position flags (which blocks and positions have a
    teacher) stay in memory, a bit each."""

    def __init__(self, rows: int, positions: int, k: int, vocab: int, columns: torch.Tensor | None = None,
                 features: int = 0, directory: str | Path | None = None):
        if not 0 < k < vocab:
            raise DraftsmithError(f"loss.teacher_topk must be in [1, {vocab}) (the target's vocabulary), got {k}")
        self.k, self.vocab, self.rows, self.positions, self.n_features = k, vocab, rows, positions, features
        self.width = vocab if columns is None else len(columns)
        # where each kept token lands: its column, or a spare last one (dropped) when the head lacks it
        self.column_of = None if columns is None else torch.full((vocab,), self.width, dtype=torch.long)
        if columns is not None:
            self.column_of[columns.cpu()] = torch.arange(self.width)
        P = positions
        self._parts = [("values", torch.float16, (P, k)), ("index", torch.int32, (P, k)), ("fill", torch.float32, (P,))]
        if features:
            self._parts.append(("features", torch.float16, (P, features)))
        self._bytes = [math.prod(shape) * torch.empty(0, dtype=dt).element_size() for _, dt, shape in self._parts]
        self.record = sum(self._bytes)
        self.directory = Path(directory or tempfile.gettempdir())
        self._file = tempfile.TemporaryFile(dir=self.directory)
        self._file.truncate(rows * self.record)
        self.filled = torch.zeros(rows, dtype=torch.bool)
        self.known = None  # (rows, positions) bool once blocks are prefilled; None: every position of a filled block
        self.known_features = None  # the same for features
        self.hits = self.misses = 0

    # -- the store ----------------------------------------------------------------------------------------------
    def read(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """{'values', 'index', 'fill'[, 'features']} of blocks `rows` as stored (zeros where never written)."""
        rows = rows.reshape(-1).tolist()
        buf = bytearray(len(rows) * self.record)
        view, fd = memoryview(buf), self._file.fileno()
        for i, r in enumerate(rows):
            got = os.preadv(fd, [view[i * self.record: (i + 1) * self.record]], r * self.record)
            if got != self.record:
                raise OSError(f"teacher store: short read of block {r} ({got} of {self.record} bytes)")
        flat = torch.frombuffer(buf, dtype=torch.uint8).view(len(rows), self.record) if rows else \
            torch.zeros(0, self.record, dtype=torch.uint8)
        out, at = {}, 0
        for (name, dtype, shape), n in zip(self._parts, self._bytes):
            out[name] = flat[:, at: at + n].contiguous().view(dtype).view(len(rows), *shape)
            at += n
        return out

    def write(self, rows: torch.Tensor, **parts: torch.Tensor) -> None:
        """Write whole records of blocks `rows` (each part (len(rows), ...) in its stored dtype; a part not given is
        kept as stored, so features can be written without the logits and the other way round)."""
        rows = rows.reshape(-1).cpu()
        if len(rows) == 0:
            return
        missing = [name for name, _, _ in self._parts if name not in parts]
        if missing:
            parts = {**{m: v for m, v in self.read(rows).items() if m in missing}, **parts}
        blob = torch.cat([parts[name].detach().cpu().to(dtype).contiguous().view(len(rows), -1).view(torch.uint8)
                          for name, dtype, _ in self._parts], 1).numpy()
        fd = self._file.fileno()
        with disk_full("the teacher store (the target's kept logits)", self.directory,
                       need=self.rows * self.record, then="free space there (the store is a temporary file of the "
                       "run directory) and resume with ckpt_path=last; the store refills as it did"):
            for i, r in enumerate(rows.tolist()):
                data, at = memoryview(blob[i].tobytes()), r * self.record
                while data:  # pwrite may write part of a record (a disk filling up): the rest, or the error
                    n = os.pwrite(fd, data, at)
                    data, at = data[n:], at + n

    # -- filling --------------------------------------------------------------------------------------------------
    def prefill(self, src: torch.Tensor, values: torch.Tensor, index: torch.Tensor, min_known: float = 0.5,
                feature_at: torch.Tensor | None = None, features: torch.Tensor | None = None,
                rows: torch.Tensor | None = None) -> int:
        """Fill blocks from logits kept elsewhere (the target's, as it sampled the corpus). `src` (blocks,
        >= positions) points each label position of blocks `rows` (default: all, in order) at a row of `values` /
        `index` (the top-k log-probabilities and their token ids, k >= this cache's, largest first), -1 where there
        is none; a cache that keeps features needs them as well (`feature_at` into `features`). A block with fewer
        than `min_known` of its positions pointed at is left to the teacher pass. Returns the blocks filled."""
        if values.shape[-1] < self.k or (self.n_features and features is None):
            return 0
        rows = torch.arange(self.rows) if rows is None else rows.cpu()
        P = self.positions
        src = src[:, :P]
        have = src >= 0
        ok = have.float().mean(1) >= min_known
        fhave = None
        if self.n_features:
            feature_at = feature_at[:, :P]
            fhave = feature_at >= 0
            ok &= fhave.float().mean(1) >= min_known
            if self.known_features is None:
                self.known_features = self.filled[:, None].expand(self.rows, P).clone()
            self.known_features[rows[ok]] = fhave[ok]
        if self.known is None:
            self.known = self.filled[:, None].expand(self.rows, P).clone()
        self.known[rows[ok]] = have[ok]
        if not ok.any():
            return 0
        src, have = src[ok], have[ok]
        top = torch.zeros(len(src), P, self.k, dtype=torch.float16)
        idx = torch.zeros(len(src), P, self.k, dtype=torch.int32)
        top[have], idx[have] = values[src[have], : self.k], index[src[have], : self.k]
        fill = torch.where(have, _tail_fill(top, self.vocab, self.k), torch.zeros((), dtype=torch.float32))
        parts = {"values": top, "index": idx, "fill": fill}
        if self.n_features:
            fat, fh = feature_at[ok], fhave[ok]
            feats = torch.zeros(len(src), P, self.n_features, dtype=torch.float16)
            feats[fh] = features[fat[fh]]
            parts["features"] = feats
        self.write(rows[ok], **parts)
        self.filled[rows[ok]] = True
        return int(ok.sum())

    def logits(self, rows: torch.Tensor, teacher, device=None, dtype=torch.float32) -> torch.Tensor:
        """(B, positions, V or N columns) logits (log-probabilities) of the blocks `rows`, on `device` in `dtype`;
        `teacher(mask)` gives the target's logits (m, positions, V) of the batch rows `mask` selects, called for
        unseen blocks only."""
        return self.outputs(rows, lambda miss: (teacher(miss), None), device, dtype)[0]

    def outputs(self, rows: torch.Tensor, teacher, device=None, dtype=torch.float32, width: int | None = None):
        """(logits as `logits` gives them, features (B, positions, F) or None), on `device` (default: the host) in
        `dtype` (the training step's: a (B, P, V) tensor in fp32 is twice what it needs to be); `teacher(mask)`
        gives the target's (logits, features) of the batch rows `mask` selects, called for unseen blocks only.
        Only what is kept crosses between host and device: the top-k in, the records out. `width`: the first that
        many positions only (a padded chat batch narrower than the longest sample: the rest is padding)."""
        rows = rows.cpu()
        miss = ~self.filled[rows]
        if miss.any():
            self._store(rows[miss], *teacher(miss.to(torch.bool)))
        self.misses += int(miss.sum())
        self.hits += len(rows) - int(miss.sum())
        got = {k: v[:, :width].to(device) for k, v in self.read(rows).items()}
        idx, fill = got["index"].long(), got["fill"].to(dtype)
        spare = self.column_of is not None
        if spare:
            idx = self._columns(idx.device)[idx]
        out = fill.unsqueeze(-1).expand(*fill.shape, self.width + spare).clone()
        feats = got["features"].to(dtype) if self.n_features else None
        return out.scatter_(-1, idx, got["values"].to(dtype))[..., : self.width], feats

    def _columns(self, device) -> torch.Tensor:
        """`column_of` on `device`, copied there once."""
        if self.column_of.device != torch.device(device):
            self.column_of = self.column_of.to(device)
        return self.column_of

    def _store(self, rows: torch.Tensor, logits: torch.Tensor, features: torch.Tensor | None = None) -> None:
        top, idx = top_logprobs(logits.detach(), self.k)  # on the device: only the kept top-k come to the host
        short = self.positions - top.shape[1]  # a narrow chat batch: the record's tail is padding, never read
        parts = {"values": torch.nn.functional.pad(top.cpu(), (0, 0, 0, short)),
                 "index": torch.nn.functional.pad(idx.cpu(), (0, 0, 0, short))}
        parts["fill"] = _tail_fill(parts["values"], self.vocab, self.k)
        if self.n_features:
            parts["features"] = torch.nn.functional.pad(half_features(features), (0, 0, 0, short))
        self.write(rows, **parts)
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
    """The target's hidden states as kept: fp16 on the CPU (halved on their device, so half as much crosses),
    refused (one line) where they exceed its range."""
    half = features.detach().half().cpu()
    if not bool(torch.isfinite(half).all()):
        raise DraftsmithError("the target's features exceed float16's range (65504), so they cannot be kept: set "
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
