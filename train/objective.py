"""What each kind of draft is trained and validated on, behind one interface: `DraftModule` has one training step
and one validation step for both kinds, as the sampler has one loop and two drafters (`sampling/speculative.py`).

An objective turns a batch into (draft logits (N, n), teacher logits (N, n) or None, labels (N,), row weights or
None) for `draft_loss`, and a held-out batch into its `val/*` figures.
"""

from __future__ import annotations

import torch

from draftsmith.drafts.batch import Batch
from draftsmith.drafts.feature import (
    feature_alpha,
    feature_batch,
    noisy_features,
    target_outputs,
    teacher_pass,
    unrolled,
)
from draftsmith.sampling.pruned import PrunedHeadDraft
from draftsmith.sampling.rejection import teacher_forced_acceptance


class IndependentObjective:
    """A small causal LM: its logits at every position against the target's, over its pruned head's tokens when it
    has one (`head_tokens`), the target's logits from the teacher cache where the corpus kept them."""

    def __init__(self, draft, head_tokens: torch.Tensor | None = None):
        self.head_tokens = head_tokens  # trained and run over these tokens only
        self._head_class = None  # each token's class in that head; -100 (no class, ignored) outside it
        if head_tokens is not None:
            self._head_class = torch.full((draft.config.vocab_size,), -100, dtype=torch.long)
            self._head_class[head_tokens] = torch.arange(len(head_tokens))

    def to(self, device) -> None:
        if self.head_tokens is not None:
            self.head_tokens, self._head_class = self.head_tokens.to(device), self._head_class.to(device)

    def sampling_draft(self, draft):
        """The draft as the sampler runs it: with its pruned head when it is trained with one."""
        return draft if self.head_tokens is None else PrunedHeadDraft(draft, self.head_tokens)

    def train_outputs(self, m, b: Batch, rows: torch.Tensor | None):
        logits = b.logits(m.draft, m.head_rows)  # (B, T-1, V), or (B, T-1, N) over a pruned head's tokens
        tlogits = self._target_logits(m, b, rows, logits.dtype)
        V = logits.shape[-1]
        logits, labels = logits.reshape(-1, V), b.ids[:, 1:].reshape(-1)
        if self.head_tokens is not None:
            labels = self._head_class[labels]
        tlogits = None if tlogits is None else tlogits.reshape(-1, V)
        unknown = self._unknown(m, b, rows)
        if b.no_loss is not None:  # data.rows=sample|packed: padding, and a label that opens the next sample
            unknown = b.no_loss if unknown is None else unknown | b.no_loss
        if unknown is not None and (tlogits is not None or b.no_loss is not None):
            # positions the target never sampled at (a prompt, the seam between samples) have no kept teacher: the
            # draft's own detached logits stand in, so every divergence and its gradient is 0 there, and the
            # batch keeps its shape (the compiled loss would recompile on every new count of kept positions)
            # (in place, on those rows only: a where over all of them copied two (N, V) tensors every step)
            at = unknown.nonzero().squeeze(1).to(logits.device)  # found on the host, where the cache knows them
            if tlogits is not None:
                tlogits[at] = logits.detach()[at].to(tlogits.dtype)
            labels = labels.index_fill(0, at, -100)
        if b.loss_mask is not None:  # on-policy rows: only the draft's own samples carry the loss
            keep = b.loss_mask.reshape(-1).nonzero().squeeze(1)
            logits, labels = logits.index_select(0, keep), labels.index_select(0, keep)
            tlogits = None if tlogits is None else tlogits.index_select(0, keep)
        return logits, tlogits, labels, None

    def _head_columns(self, logits: torch.Tensor) -> torch.Tensor:
        return logits if self.head_tokens is None else logits.index_select(-1, self.head_tokens)

    def _target_logits(self, m, b: Batch, rows: torch.Tensor | None, dtype=torch.float32):
        if not m.distill:
            return None
        with torch.no_grad():  # not inference_mode: its tensors would need a full-vocab copy to enter autograd
            if m.teacher_cache is None or rows is None:
                return self._head_columns(b.logits(m.target))
            # the draft's own rows are new each time; the corpus rows after them come from the teacher cache
            n = b.sampled
            parts = [] if n == 0 else [self._head_columns(Batch(
                b.ids[:n], None if b.mask is None else b.mask[:n]).logits(m.target))]
            if n < len(b.ids):
                parts.append(m.kept_outputs(Batch(b.ids[n:], None if b.mask is None else b.mask[n:]), rows[n:],
                                            lambda sub: (sub.logits(m.target), None), dtype)[0])
            return parts[0] if len(parts) == 1 else torch.cat(parts)  # cat copies even one part: a (B, P, V) copy

    def _unknown(self, m, b: Batch, rows: torch.Tensor | None) -> torch.Tensor | None:
        """(B (T-1),) bool, on the host: label positions of kept blocks that have no teacher (data/teacher.py
        `known`)."""
        if m.teacher_cache is None or rows is None:
            return None
        known = m.teacher_cache.known_rows(rows[b.sampled:])
        known = None if known is None else known[:, : b.ids.shape[1] - 1]  # a chat batch: as wide as it is
        if known is None or bool(known.all()):
            return None
        unknown = torch.zeros(b.ids.shape[0], b.ids.shape[1] - 1, dtype=torch.bool)
        unknown[b.sampled:] = ~known
        return unknown.reshape(-1)

    def validate(self, m, ids) -> dict:
        """Teacher-forced alpha_analytic on held-out blocks: sum_x min(p, q) of the processed distributions. A
        Batch with a loss mask (data=chat) is scored where it trains: the assistant's tokens, padding aside."""
        b = ids if isinstance(ids, Batch) else Batch(ids)
        logits = b.logits(self.sampling_draft(m.draft))  # a pruned head's: -inf outside its tokens
        tlogits = b.logits(m.target)  # validation already runs without grad
        V = logits.shape[-1]
        labels = b.ids[:, 1:].reshape(-1)
        if self.head_tokens is not None:  # a token outside a pruned head has no class (its logit is -inf)
            labels = torch.where(self._head_class[labels] >= 0, labels, -100)
        keep = None if b.loss_mask is None else b.loss_mask.reshape(-1).bool()
        if keep is not None:
            labels = torch.where(keep, labels, -100)
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, V).float(), labels)
        acc = teacher_forced_acceptance(logits, tlogits, m.sampling)
        return {"val/loss": ce, "val/alpha_analytic": acc.mean() if keep is None else acc[keep].mean()}


class FeatureObjective:
    """EAGLE-3's head: one teacher pass gives the features it reads and the logits it matches (kept after a block's
    first visit, with loss.teacher_topk); every unrolled step is scored against the same teacher (slot j predicts
    x_{j+2} at every step), all steps in one loss call, step s weighing step_decay ** s (EAGLE-3's 0.8: an accepted
    run ends at its first rejection, so the first draft counts most)."""

    head_tokens = None  # a pruned feature head carries its own token ids (FeatureDraft.token_ids)

    def __init__(self, unroll: int = 4, step_decay: float = 1.0, feature_noise: float = 0.0):
        self.unroll, self.step_decay = unroll, step_decay  # the training-time test's steps and their weights
        self.feature_noise = feature_noise  # noise on the features it reads in training (EAGLE-1's)

    def to(self, device) -> None:
        pass

    def sampling_draft(self, draft):
        return draft

    def train_outputs(self, m, b: Batch, rows: torch.Tensor | None):
        layers = m.draft.feature_layers
        cache = m.teacher_cache
        if cache is not None and rows is not None and b.loss_mask is None:  # kept: it never has sampled rows
            fb = feature_batch(b, *m.kept_outputs(b, rows, lambda sub: target_outputs(m.target, layers, sub)),
                               cache.known_rows(rows), cache.known_feature_rows(rows))
        else:
            fb = teacher_pass(m.target, layers, b)
        if self.feature_noise:
            fb.features = noisy_features(fb.features, len(layers), self.feature_noise)
        logits, tlogits, labels, sizes = unrolled(m.draft, fb, self.unroll)
        weights = None
        if self.step_decay != 1.0:
            dev = logits.device
            per_step = self.step_decay ** torch.arange(len(sizes), dtype=torch.float32, device=dev)
            weights = per_step.repeat_interleave(torch.tensor(sizes, device=dev))
        return logits, tlogits if m.distill else None, labels, weights

    def validate(self, m, ids: torch.Tensor) -> dict:
        """alpha_analytic, the mean over the unrolled steps (draft positions 1..K)."""
        steps = feature_alpha(m.target, m.draft, ids if isinstance(ids, Batch) else Batch(ids), m.sampling,
                              self.unroll)
        return {"val/alpha_analytic": sum(steps) / len(steps)}
