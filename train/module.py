"""The LightningModule: a trainable draft distilled online from a frozen target."""

from __future__ import annotations

import math
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import Timer

from draftsmith.data.teacher import TeacherCache
from draftsmith.drafts.batch import Batch, HeadRows
from draftsmith.sampling.errors import DraftsmithError
from draftsmith.sampling.feature import is_feature_draft
from draftsmith.sampling.probs import SamplingConfig
from draftsmith.train.losses import draft_loss
from draftsmith.train.objective import FeatureObjective, IndependentObjective
from draftsmith.train.onpolicy import OnPolicy
from draftsmith.train.rundir import partitioned


class Combined(torch.optim.Optimizer):
    """Several optimizers stepped as one: Lightning's automatic optimisation takes one. Their param groups are this
    one's (the same dicts), so the LR schedule, gradient clipping and a skipped step reach every group."""

    def __init__(self, *optimizers: torch.optim.Optimizer):
        self.optimizers = optimizers
        super().__init__([p for o in optimizers for g in o.param_groups for p in g["params"]], {})
        self.param_groups = [g for o in optimizers for g in o.param_groups]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for o in self.optimizers:
            o.step()
        return loss

    def zero_grad(self, set_to_none: bool = True):
        for o in self.optimizers:
            o.zero_grad(set_to_none)

    def state_dict(self):
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state):
        for o, s in zip(self.optimizers, state["optimizers"]):
            o.load_state_dict(s)


OPTIMIZERS = ("adamw", "muon")


def optimizer(draft, o: dict) -> torch.optim.Optimizer:
    """optim.name: `adamw` (every trainable weight), or `muon`: Muon (Jordan et al. 2024; `torch.optim.Muon`) on the
    hidden layers' 2-D weights and AdamW on the rest (norms, and the embeddings and head when they train), as its
    authors and speculators' default run it. Muon's updates are scaled to AdamW's RMS (Liu et al. 2025, "Muon is
    Scalable for LLM Training", arXiv 2502.16982: `match_rms_adamw`), so one optim.lr and weight decay serve both
    and a learning-rate sweep moves both together; optim.muon_lr sets Muon's apart."""
    name = o.get("name", "adamw")
    if name not in OPTIMIZERS:
        raise DraftsmithError(f"optim.name must be one of {', '.join(OPTIMIZERS)}, got {name!r}")
    params = [p for p in draft.parameters() if p.requires_grad]
    adamw = dict(lr=o["lr"], betas=tuple(o.get("betas", (0.9, 0.98))), weight_decay=o.get("weight_decay", 0.01))
    if name == "adamw":
        return torch.optim.AdamW(params, **adamw)
    ends = {id(m.weight) for m in (getattr(draft, "get_input_embeddings", lambda: None)(),
                                   getattr(draft, "get_output_embeddings", lambda: None)()) if m is not None}
    matrices = [p for p in params if p.ndim == 2 and id(p) not in ends]
    rest = [p for p in params if p.ndim != 2 or id(p) in ends]
    if not matrices:
        raise DraftsmithError("optim.name=muon: the draft has no trainable hidden 2-D weight; use optim.name=adamw")
    muon = torch.optim.Muon(matrices, lr=o.get("muon_lr") or o["lr"], weight_decay=o.get("weight_decay", 0.01),
                            momentum=o.get("muon_momentum", 0.95), adjust_lr_fn="match_rms_adamw")
    return Combined(muon, torch.optim.AdamW(rest, **adamw)) if rest else muon


class WeightAverage(torch.nn.Module):
    """An exponential moving average of the draft's trainable weights (optim.ema = its decay), in fp32 buffers:
    saved in every checkpoint (`ema.*`), measured by validation in place of the raw weights, exported by the
    report. Polyak averaging: the average of a run's late iterates generalises better than the last one (Polyak &
    Juditsky 1992; Izmailov et al. 2018, SWA), which is what a run past ~3.5 epochs on the same samples needs. The
    decay warms up as min(decay, (1 + step) / (10 + step)) (TensorFlow's ExponentialMovingAverage), so a short run's
    average does not stay at its initial weights."""

    def __init__(self, draft, decay: float):
        super().__init__()
        if not 0 < decay < 1:
            raise DraftsmithError(f"optim.ema must be in (0, 1) (the average's decay per step; 0 = off), got {decay}")
        self.decay = decay
        self.names = [n for n, p in draft.named_parameters() if p.requires_grad]
        params = dict(draft.named_parameters())
        for n in self.names:
            self.register_buffer(self.key(n), params[n].detach().float().clone())

    @staticmethod
    def key(name: str) -> str:
        return name.replace(".", "__")

    def _pairs(self, draft):
        params = dict(draft.named_parameters())
        return [(params[n], getattr(self, self.key(n))) for n in self.names]

    @torch.no_grad()
    def update(self, draft, step: int) -> None:
        d = min(self.decay, (1 + step) / (10 + step))
        for p, avg in self._pairs(draft):
            avg.lerp_(p.detach().float(), 1 - d)

    @torch.no_grad()
    def swap_in(self, draft) -> list[torch.Tensor]:
        """Puts the average in the draft's weights; returns the raw ones for `restore`."""
        raw = []
        for p, avg in self._pairs(draft):
            raw.append(p.detach().clone())
            p.copy_(avg)
        return raw

    @torch.no_grad()
    def restore(self, draft, raw: list[torch.Tensor]) -> None:
        for (p, _), r in zip(self._pairs(draft), raw):
            p.copy_(r)

    @staticmethod
    @torch.no_grad()
    def load_into(draft, state: dict) -> bool:
        """A checkpoint's average (its `ema.*` entries) into `draft`'s weights; False when it holds none."""
        found = False
        for n, p in draft.named_parameters():
            avg = state.get(f"ema.{WeightAverage.key(n)}")
            if avg is not None:
                p.copy_(avg)
                found = True
        return found


class DraftModule(L.LightningModule):
    """Holds the draft (trained) and the target (frozen, outside the module's parameters).

    The target is kept out of `nn.Module` registration on purpose: it never enters `state_dict`, so it is never
    saved in a draft checkpoint, never wrapped or partitioned by DDP/DeepSpeed, and never touched by the optimiser.
    `validate_on_first`: only rank 0 holds the target (the others train on its kept logits and hold None), so with
    several ranks the held-out figures are measured there, by the acceptance callback, and sent to every rank.
    """

    def __init__(self, draft, target, *, loss: dict, optim: dict, sampler: dict, max_steps: int,
                 on_policy: OnPolicy | None = None, unroll: int = 4, step_decay: float = 1.0,
                 feature_noise: float = 0.0,
                 teacher_cache: TeacherCache | None = None, head_tokens: torch.Tensor | None = None,
                 validate_on_first: bool = False, row_positions: torch.Tensor | None = None, packed: bool = False):
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
        self.teacher_cache = teacher_cache  # the target's top-k logits per block, kept after its first visit
        self.distill = loss.get("distill", True)
        self.validate_on_first = validate_on_first
        # the kind of draft in one object: what a batch trains it on and what validation measures
        self.objective = (FeatureObjective(unroll, step_decay, feature_noise) if is_feature_draft(draft)
                          else IndependentObjective(draft, head_tokens))
        # a pruned head's rows, computed in a forward of their own (registered here, so that DeepSpeed hooks it)
        self.head_rows = None if head_tokens is None else HeadRows(draft, head_tokens)
        self._skip_step = False
        # data.rows=sample|packed: each training row's tokens' positions in their own samples (-1: padding), looked
        # up by row index; packed rows pass them to the model, which then masks attention per sample
        self.row_positions, self.packed = row_positions, packed
        if row_positions is not None and (is_feature_draft(draft) or self.on_policy is not None):
            raise DraftsmithError("data.rows=sample or packed trains an independent draft on the corpus' own rows: a "
                                  "feature draft or on-policy rows (data.on_policy_fraction > 0) need data.rows=stream")
        # loss.truncate: the TV term between the distributions the sampler accepts from (temperature, top-k, top-p)
        self.truncate = (SamplingConfig(loss.get("temperature", 1.0), sampler.get("top_k", 0),
                                        sampler.get("top_p", 1.0)) if loss.get("truncate") else None)
        # optim.ema: an average of the weights, which validation measures and the report exports (train/optim.py)
        decay = float(optim.get("ema") or 0.0)
        self.ema = WeightAverage(draft, decay) if decay else None
        self._raw = None

    @property
    def target(self):
        return self._target[0]

    @property
    def head_tokens(self) -> torch.Tensor | None:
        """An independent draft's pruned head's tokens (None: a full head, or a feature draft)."""
        return self.objective.head_tokens

    @property
    def first_only(self) -> bool:
        """The target is on rank 0 alone, and there are other ranks: validation is rank 0's (train/callbacks.py)."""
        return self.validate_on_first and self.trainer.world_size > 1

    def place_target(self):
        """The target on the draft's device (Lightning moves the module, not what it hides), and returned. A target
        sharded over devices (`device_map`) stays where it was put; a rank that trains only holds none."""
        if self.target is not None and not getattr(self.target, "hf_device_map", None):
            self._target[0] = self.target.to(self.device)
        return self.target

    def on_fit_start(self):
        if self.row_positions is not None and self.global_rank == 0:
            pos = self.row_positions
            print(f"draftsmith: data.rows={'packed' if self.packed else 'sample'}: {len(pos)} rows of whole samples "
                  f"({int((pos == 0).sum())} samples), {float((pos < 0).float().mean()):.0%} padding", flush=True)
        self.place_target()
        self.objective.to(self.device)
        if self.on_policy is not None:  # every rank its own samples, not the same ones world_size times
            self.on_policy.seed_rank(self.global_rank)
        if self.head_rows is not None and partitioned(self.draft):
            if self.on_policy is not None:  # the sampler's pruned head copies the head's rows, an empty shard here
                raise DraftsmithError("data.on_policy_fraction > 0 with a pruned head (draft.draft_vocab) cannot run "
                                      "under ZeRO-3, whose head is sharded outside its forward: use "
                                      "trainer=deepspeed_stage_2 or fsdp, or draft.draft_vocab=null")
            import deepspeed

            # ZeRO-3: the head's weight is an empty shard outside its owner's forward; DeepSpeed gathers it for
            # `head_rows`' forward once told that module reads it
            deepspeed.zero.register_external_parameter(self.head_rows, self.draft.get_output_embeddings().weight)

    def sampling_draft(self):
        """The draft as the sampler runs it: with its pruned head when it is trained with one."""
        return self.objective.sampling_draft(self.draft)

    def kept_outputs(self, b: Batch, rows: torch.Tensor, teacher, dtype=torch.float32):
        """(logits, features or None) of blocks `rows` from the teacher cache, on this module's device in `dtype`
        (the draft's logits'); `teacher(sub_batch)` runs the target on the rows it has not seen yet (chosen on the
        host: the cache knows which)."""
        cache = self.teacher_cache

        def unseen(miss):  # the rows the cache has not seen, with their padding mask (a chat batch's)
            sel = miss.nonzero().squeeze(1).to(b.ids.device)
            return teacher(Batch(b.ids[sel], None if b.mask is None else b.mask[sel],
                                 position_ids=None if b.position_ids is None else b.position_ids[sel]))

        logits, feats = cache.outputs(rows, unseen, self.device, dtype, width=b.ids.shape[1] - 1)
        self.log("train/teacher_cache_hit_rate", cache.hit_rate)
        return logits, feats

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
        if isinstance(batch, dict):  # data=chat: one sample a row from position 0, the loss on assistant tokens
            # its sample indices key the target's logits kept for them (loss.teacher_topk), when there are any
            b, rows = Batch(batch["ids"], batch["mask"], batch["loss_mask"]), batch.get("rows")
            ids = b.ids
        else:
            ids = batch[0] if isinstance(batch, (list, tuple)) else batch
            rows = batch[1] if isinstance(batch, (list, tuple)) and len(batch) > 1 else None  # block indices
            b = Batch(ids) if self.row_positions is None or rows is None else self._sample_batch(ids, rows)
        if self.on_policy is not None:
            t = time.perf_counter()
            b = self.on_policy(self.sampling_draft, ids, self._progress())  # as deployed: its pruned head
            self.log("train/on_policy_s", time.perf_counter() - t)
        logits, tlogits, labels, row_weights = self.objective.train_outputs(self, b, rows)
        total, parts = draft_loss(logits, labels, tlogits, self._weights(), self.loss_cfg.get("temperature", 1.0),
                                  self.loss_cfg.get("compile", True), row_weights, truncate=self.truncate)
        if not self._all_finite(total):  # skip the step on every rank alike; stop if it keeps happening
            self.nonfinite_steps += 1
            self._nonfinite_run += 1
            self.log("train/nonfinite_steps", float(self.nonfinite_steps))
            if self._nonfinite_run >= self.max_nonfinite:
                raise DraftsmithError(
                    f"the loss was NaN or Inf for {self._nonfinite_run} steps in a row (step {self.global_step}): "
                    "stopping before a poisoned checkpoint is saved; lower optim.lr or check the data")
            if self._ranks == 1:
                return None  # Lightning skips backward and update
            # with several ranks Lightning refuses None, and a rank that skipped its backward would leave the others
            # waiting in the gradient all-reduce: every rank runs a backward of zeros, and the update is dropped
            # (`on_before_optimizer_step`)
            self._skip_step = True
            return sum(p.sum() for p in self.draft.parameters() if p.requires_grad) * 0.0
        self._nonfinite_run = 0
        self.log("train/loss", total, prog_bar=True)
        for k, v in parts.items():
            self.log(f"train/{k}", v)
        real = ids.numel() if b.mask is None else int(b.mask.sum())  # padding is not throughput
        self._tokens_seen += real
        now = time.perf_counter()
        if self._t_last is not None:
            self.log("train/tokens_per_s", real * self.trainer.world_size / (now - self._t_last), prog_bar=True)
        self._t_last = now
        self.log("train/lr", self.optimizers().param_groups[0]["lr"])
        return total

    def _sample_batch(self, ids: torch.Tensor, rows: torch.Tensor) -> Batch:
        """A batch of data.rows=sample|packed rows: a label carries loss only inside its own sample (not padding, not
        the next sample's first token); packed rows restart their positions at each sample."""
        pos = self.row_positions[rows.cpu()]
        no_loss = (pos[:, 1:] < 1).reshape(-1)  # stays on the host, as the teacher cache's flags do
        return Batch(ids, position_ids=pos.clamp_min(0).to(ids.device) if self.packed else None, no_loss=no_loss)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.ema is not None:
            self.ema.update(self.draft, self.global_step)

    def on_validation_epoch_start(self):
        if self.ema is not None and self._raw is None:  # validation (and the acceptance callback) measure the average
            self._raw = self.ema.swap_in(self.draft)

    def on_fit_end(self):
        if self.ema is not None:  # the draft the report measures as "last" is the average, as exported
            self._restore()
            self.ema.swap_in(self.draft)

    def _restore(self):
        if self._raw is not None:
            self.ema.restore(self.draft, self._raw)
            self._raw = None

    @property
    def _ranks(self) -> int:
        return self._trainer.world_size if self._trainer is not None else 1

    def _all_finite(self, loss: torch.Tensor) -> bool:
        """Whether the loss is finite on every rank: one flag reduced over the ranks (one read per step, which the
        step's logging pays anyway), so that every rank takes the same branch."""
        bad = (~torch.isfinite(loss.detach())).float()
        if self._ranks > 1:
            bad = self.trainer.strategy.reduce(bad, reduce_op="sum")
        return not bool(bad)

    def on_before_optimizer_step(self, optimizer):
        """A step skipped on every rank (a non-finite loss somewhere): its gradients (zeros) are dropped, and the
        optimizer passes over parameters without one, so no moment or weight moves. Under DeepSpeed the engine owns
        the gradients and steps with the zeros (its moments decay once)."""
        if self._skip_step:
            self._skip_step = False
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None

    def on_validation_epoch_end(self):
        self._t_last = None  # the next step's throughput must not include validation time
        if self.ema is not None:  # after the callbacks' own epoch end (Lightning calls them first): training goes on
            self._restore()  # from the raw weights

    def validation_step(self, batch, batch_idx):
        """Teacher-forced alpha_analytic on held-out blocks (train/objective.py, per kind of draft)."""
        if self.first_only:  # `held_out` on rank 0, over all of them
            return
        ids = (Batch(batch["ids"], batch["mask"], batch["loss_mask"]) if isinstance(batch, dict)
               else batch[0] if isinstance(batch, (list, tuple)) else batch)
        for name, value in self.objective.validate(self, ids).items():
            self.log(name, value, sync_dist=True, prog_bar=name == "val/alpha_analytic")

    @torch.no_grad()
    def held_out(self, dataset, batch_size: int) -> dict[str, float]:
        """`validation_step`'s figures over a whole held-out dataset in one process, weighted by batch size as
        Lightning averages them."""
        sums, n = {}, 0
        for batch in torch.utils.data.DataLoader(dataset, batch_size=batch_size):
            ids = (batch[0] if isinstance(batch, (list, tuple)) else batch).to(self.device)
            for name, value in self.objective.validate(self, ids).items():
                sums[name] = sums.get(name, 0.0) + float(value) * len(ids)
            n += len(ids)
        return {name: total / max(1, n) for name, total in sums.items()}

    def configure_optimizers(self):
        o = self.optim_cfg
        opt = optimizer(self.draft, o)
        warmup, floor = o.get("warmup_steps", 30), o.get("min_lr_ratio", 0.1)

        def schedule(step):  # linear warm-up, then cosine to floor * lr at max_steps
            if step < warmup:
                return (step + 1) / warmup
            t = max(min(1.0, (step - warmup) / max(1, self.max_steps - warmup)), self._progress())
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
