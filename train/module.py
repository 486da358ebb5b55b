"""The LightningModule: a trainable draft distilled online from a frozen target."""

from __future__ import annotations

import math
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import Timer

from draftsmith.sampling.feature import is_feature_draft
from draftsmith.sampling.probs import SamplingConfig
from draftsmith.sampling.pruned import PrunedHeadDraft
from draftsmith.sampling.rejection import teacher_forced_acceptance
from draftsmith.train.feature import (
    feature_alpha,
    feature_batch,
    noisy_features,
    target_outputs,
    teacher_pass,
    unrolled,
)
from draftsmith.train.losses import draft_loss
from draftsmith.train.onpolicy import Batch, OnPolicy
from draftsmith.train.teacher import TeacherCache


class DraftModule(L.LightningModule):
    """Holds the draft (trained) and the target (frozen, outside the module's parameters).

    The target is kept out of `nn.Module` registration on purpose: it never enters `state_dict`, so it is never
    saved in a draft checkpoint, never wrapped or partitioned by DDP/DeepSpeed, and never touched by the optimiser.
    """

    def __init__(self, draft, target, *, loss: dict, optim: dict, sampler: dict, max_steps: int,
                 on_policy: OnPolicy | None = None, unroll: int = 4, step_decay: float = 1.0,
                 feature_noise: float = 0.0,
                 teacher_cache: TeacherCache | None = None, head_tokens: torch.Tensor | None = None):
        super().__init__()
        self.draft = draft
        self._target = [target]  # a list hides it from nn.Module registration
        self.loss_cfg, self.optim_cfg, self.max_steps = loss, optim, max_steps
        self.on_policy = on_policy if on_policy is not None and on_policy.fraction > 0 else None
        self.sampling = SamplingConfig(sampler["temperature"], sampler.get("top_k", 0), sampler.get("top_p", 1.0))
        self.save_hyperparameters({"loss": loss, "optim": optim, "sampler": sampler, "max_steps": max_steps})
        self._tokens_seen = 0
        self._t_last = None
        self.nonfinite_steps, self._nonfinite_run, self.max_nonfinite = 0, 0, 5
        self.feature = is_feature_draft(draft)
        self.unroll, self.step_decay = unroll, step_decay  # feature draft: the training-time test's steps, weights
        self.feature_noise = feature_noise  # and the noise on the features it reads in training (EAGLE-1's)
        self.teacher_cache = teacher_cache  # the target's top-k logits per block, kept after its first visit
        self.head_tokens = head_tokens  # an independent draft's pruned head: trained and run over these tokens only
        if head_tokens is not None:  # each token's class in that head; -100 (no class, ignored) outside it
            self._head_class = torch.full((draft.config.vocab_size,), -100, dtype=torch.long)
            self._head_class[head_tokens] = torch.arange(len(head_tokens))

    @property
    def target(self):
        return self._target[0]

    def on_fit_start(self):
        self._target[0] = self.target.to(self.device)
        if self.head_tokens is not None:
            self.head_tokens, self._head_class = self.head_tokens.to(self.device), self._head_class.to(self.device)

    def sampling_draft(self):
        """The draft as the sampler runs it: with its pruned head when it is trained with one."""
        if self.head_tokens is None:
            return self.draft
        return PrunedHeadDraft(self.draft, self.head_tokens)

    def _target_logits(self, b: Batch, rows: torch.Tensor | None):
        if not self.loss_cfg.get("distill", True):
            return None
        with torch.no_grad():  # not inference_mode: its tensors would need a full-vocab copy to enter autograd
            if self.teacher_cache is None or rows is None:
                return self._head_columns(b.logits(self.target))
            # the draft's own rows are new each time; the corpus rows after them come from the teacher cache
            n = b.sampled
            parts = [] if n == 0 else [self._head_columns(Batch(
                b.ids[:n], None if b.mask is None else b.mask[:n]).logits(self.target))]
            if n < len(b.ids):
                parts.append(self._kept_outputs(Batch(b.ids[n:]), rows[n:],
                                                lambda sub: (sub.logits(self.target), None))[0])
            return torch.cat(parts)

    def _head_columns(self, logits: torch.Tensor) -> torch.Tensor:
        return logits if self.head_tokens is None else logits.index_select(-1, self.head_tokens)

    def _kept(self, b: Batch, rows: torch.Tensor | None) -> bool:
        """Whether a feature draft's target outputs on `b` come from the teacher cache (it never has sampled rows)."""
        return self.teacher_cache is not None and rows is not None and b.loss_mask is None

    def _kept_outputs(self, b: Batch, rows: torch.Tensor, teacher):
        """(logits, features or None) of blocks `rows` from the teacher cache; `teacher(sub_batch)` runs the target
        on the rows it has not seen yet."""
        cache = self.teacher_cache
        logits, feats = cache.outputs(rows, lambda miss: teacher(Batch(b.ids[miss.to(b.ids.device)])))
        self.log("train/teacher_cache_hit_rate", cache.hit_rate)
        return logits.to(self.device), None if feats is None else feats.to(self.device)

    def _progress(self) -> float:
        """Fraction of training done: by steps, or by wall time when `trainer.max_time` bounds the run (so a
        time-boxed run, an ablation at equal wall time, still anneals and decays fully)."""
        frac = self.global_step / max(1, self.max_steps)
        timer = next((c for c in self.trainer.callbacks if isinstance(c, Timer)), None) if self._trainer else None
        if timer is not None and timer.time_remaining("train") is not None:
            spent = timer.time_elapsed("train")
            frac = max(frac, spent / max(1e-9, spent + timer.time_remaining("train")))
        return min(1.0, frac)

    def _weights(self) -> dict:
        w = dict(self.loss_cfg["weights"])
        anneal = self.loss_cfg.get("anneal")
        if anneal:  # linear from the term's weight to `to` over the first `over` fraction of training
            frac = min(1.0, self._progress() / anneal["over"])
            w[anneal["term"]] = w[anneal["term"]] + frac * (anneal["to"] - w[anneal["term"]])
        return w

    def training_step(self, batch, batch_idx):
        ids = batch[0] if isinstance(batch, (list, tuple)) else batch
        rows = batch[1] if isinstance(batch, (list, tuple)) and len(batch) > 1 else None  # block indices
        b = Batch(ids)
        if self.on_policy is not None:
            t = time.perf_counter()
            b = self.on_policy(self.sampling_draft, ids, self._progress())  # as deployed: its pruned head
            self.log("train/on_policy_s", time.perf_counter() - t)
        row_weights = None
        if self.feature:
            logits, tlogits, labels, row_weights = self._feature_logits(b, rows)
        else:
            logits, tlogits, labels = self._draft_logits(b, rows)
        total, parts = draft_loss(logits, labels, tlogits, self._weights(), self.loss_cfg.get("temperature", 1.0),
                                  self.loss_cfg.get("compile", True), row_weights)
        if not bool(torch.isfinite(total)):  # skip the step (no backward, no update); stop if it keeps happening
            self.nonfinite_steps += 1
            self._nonfinite_run += 1
            self.log("train/nonfinite_steps", float(self.nonfinite_steps))
            if self._nonfinite_run >= self.max_nonfinite:
                raise FloatingPointError(
                    f"the loss was NaN or Inf for {self._nonfinite_run} steps in a row (step {self.global_step}): "
                    "stopping before a poisoned checkpoint is saved; lower optim.lr or check the data")
            return None
        self._nonfinite_run = 0
        self.log("train/loss", total, prog_bar=True)
        for k, v in parts.items():
            self.log(f"train/{k}", v)
        self._tokens_seen += ids.numel()
        now = time.perf_counter()
        if self._t_last is not None:
            self.log("train/tokens_per_s", ids.numel() * self.trainer.world_size / (now - self._t_last), prog_bar=True)
        self._t_last = now
        self.log("train/lr", self.optimizers().param_groups[0]["lr"])
        return total

    def _feature_logits(self, b: Batch, rows: torch.Tensor | None = None):
        """One teacher pass gives the features and the logits (kept after a block's first visit, with
        loss.teacher_topk); every unrolled step is scored against the same teacher (slot j predicts x_{j+2} at
        every step), all steps in one loss call, step s weighing step_decay ** s (EAGLE-3's 0.8: an accepted
        run ends at its first rejection, so the first draft counts most)."""
        layers = self.draft.feature_layers
        if self._kept(b, rows):
            cache = self.teacher_cache
            fb = feature_batch(b, *self._kept_outputs(b, rows, lambda sub: target_outputs(self.target, layers, sub)),
                               cache.known_rows(rows), cache.known_feature_rows(rows))
        else:
            fb = teacher_pass(self.target, layers, b)
        if self.feature_noise:
            fb.features = noisy_features(fb.features, len(layers), self.feature_noise)
        logits, tlogits, labels, sizes = unrolled(self.draft, fb, self.unroll)
        weights = None
        if self.step_decay != 1.0:
            dev = logits.device
            per_step = self.step_decay ** torch.arange(len(sizes), dtype=torch.float32, device=dev)
            weights = per_step.repeat_interleave(torch.tensor(sizes, device=dev))
        return logits, tlogits if self.loss_cfg.get("distill", True) else None, labels, weights

    def _draft_logits(self, b: Batch, rows: torch.Tensor | None = None):
        logits = b.logits(self.draft, self.head_tokens)  # (B, T-1, V), or (B, T-1, N) over a pruned head's tokens
        tlogits = self._target_logits(b, rows)
        V = logits.shape[-1]
        logits, labels = logits.reshape(-1, V), b.ids[:, 1:].reshape(-1)
        if self.head_tokens is not None:
            labels = self._head_class[labels]
        tlogits = None if tlogits is None else tlogits.reshape(-1, V)
        unknown = self._unknown(b, rows)
        if unknown is not None and tlogits is not None:
            # positions the target never sampled at (a prompt, the seam between samples) have no kept teacher: the
            # draft's own detached logits stand in, so every divergence and its gradient is 0 there, and the
            # batch keeps its shape (the compiled loss would recompile on every new count of kept positions)
            # (in place, on those rows only: a where over all of them copied two (N, V) tensors every step)
            at = unknown.nonzero().squeeze(1)
            tlogits[at] = logits.detach()[at].to(tlogits.dtype)
            labels = labels.masked_fill(unknown, -100)
        if b.loss_mask is not None:  # on-policy rows: only the draft's own samples carry the loss
            keep = b.loss_mask.reshape(-1).nonzero().squeeze(1)
            logits, labels = logits.index_select(0, keep), labels.index_select(0, keep)
            tlogits = None if tlogits is None else tlogits.index_select(0, keep)
        return logits, tlogits, labels

    def _unknown(self, b: Batch, rows: torch.Tensor | None) -> torch.Tensor | None:
        """(B (T-1),) bool: label positions of kept blocks that have no teacher (train/teacher.py `known`)."""
        if self.teacher_cache is None or rows is None:
            return None
        known = self.teacher_cache.known_rows(rows[b.sampled:])
        if known is None or bool(known.all()):
            return None
        unknown = torch.zeros(b.ids.shape[0], b.ids.shape[1] - 1, dtype=torch.bool)
        unknown[b.sampled:] = ~known
        return unknown.reshape(-1).to(self.device)

    def on_validation_epoch_end(self):
        self._t_last = None  # the next step's throughput must not include validation time

    def validation_step(self, batch, batch_idx):
        """Teacher-forced alpha_analytic on held-out blocks: sum_x min(p, q) of the processed distributions."""
        ids = batch[0] if isinstance(batch, (list, tuple)) else batch
        if self.feature:  # mean over the unrolled steps (draft positions 1..K)
            steps = feature_alpha(self.target, self.draft, Batch(ids), self.sampling, self.unroll)
            self.log("val/alpha_analytic", sum(steps) / len(steps), sync_dist=True, prog_bar=True)
            return
        inputs, labels = ids[:, :-1], ids[:, 1:]
        logits = self.sampling_draft()(input_ids=inputs).logits  # a pruned head's: -inf outside its tokens
        tlogits = self.target(input_ids=inputs).logits  # validation already runs without grad
        V = logits.shape[-1]
        labels = labels.reshape(-1)
        if self.head_tokens is not None:  # a token outside a pruned head has no class (its logit is -inf)
            labels = torch.where(self._head_class[labels] >= 0, labels, -100)
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, V).float(), labels)
        acc = teacher_forced_acceptance(logits, tlogits, self.sampling)
        self.log("val/loss", ce, sync_dist=True)
        self.log("val/alpha_analytic", acc.mean(), sync_dist=True, prog_bar=True)

    def configure_optimizers(self):
        o = self.optim_cfg
        params = [p for p in self.draft.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=o["lr"], betas=tuple(o.get("betas", (0.9, 0.98))),
                                weight_decay=o.get("weight_decay", 0.01))
        warmup, floor = o.get("warmup_steps", 30), o.get("min_lr_ratio", 0.1)

        def schedule(step):  # linear warm-up, then cosine to floor * lr at max_steps
            if step < warmup:
                return (step + 1) / warmup
            t = max(min(1.0, (step - warmup) / max(1, self.max_steps - warmup)), self._progress())
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
