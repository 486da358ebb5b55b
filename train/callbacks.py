"""Validation by acceptance measured with the bundled sampler: the only place training calls `sampling/`."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import lightning as L
import torch
from safetensors.torch import load_file, save_file

from draftsmith.drafts.batch import Batch
from draftsmith.drafts.evaluate import alpha_on_samples, target_samples
from draftsmith.sampling import autoregressive_generate, speculative_generate
from draftsmith.sampling.cost import expected_tokens_per_call, measure_costs, predicted_speedup
from draftsmith.sampling.feature import is_feature_draft
from draftsmith.sampling.machine import atomic_path, device_of, seeded
from draftsmith.sampling.probs import SamplingConfig
from draftsmith.sampling.pruned import PrunedHeadDraft
from draftsmith.sampling.stats import TAU
from draftsmith.train.rundir import sharded
from draftsmith.train.tracking import log_tables


@contextlib.contextmanager
def whole(module):
    """The draft's parameters whole on every rank inside the block: ZeRO-3 and FSDP shard them, and the sampler
    runs the draft outside the training forward, so it needs them all. Collective (every rank enters it, as
    Lightning runs these hooks on every rank)."""
    kind = sharded(module)
    if kind is None:
        yield
    elif kind == "zero3":
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.draft.parameters()), modifier_rank=None):
            yield
    else:  # FSDP wraps the whole LightningModule: its root unit gathers every shard
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(module.trainer.strategy.model, writeback=False):
            yield


def standalone(draft, dtype):
    """A copy of `draft` (whole: inside `whole`) in `dtype`, made of plain tensors: under ZeRO-3 a deep copy would
    also copy DeepSpeed's hooks and shard bookkeeping, and the copy's forward would then fetch shards it does not
    own. Rebuilt from its config on its device and given the weights; a pruned head keeps its rows."""
    if isinstance(draft, PrunedHeadDraft):
        return PrunedHeadDraft(standalone(draft.draft, dtype), draft.token_ids).eval()
    state = {k: v.detach() for k, v in draft.state_dict().items()}
    with torch.device(device_of(draft)):
        out = type(draft)(draft.config)
    out.load_state_dict(state)
    return out.to(dtype).eval().requires_grad_(False)


class AcceptanceCallback(L.Callback):
    """At every validation:
    - `val/alpha_on_target`: teacher-forced alpha_analytic of the draft on a fixed set of the target's own samples
      (drawn once at fit start and kept in the run dir as `val_target_samples.safetensors`): on-distribution and
      free of sampling noise, so it is the default checkpoint monitor;
    - `val/alpha`, `val/tokens_per_call`, `val/predicted_speedup`: the bundled sampler run with the current draft on
      held-out prompts (c and v(K) measured on this machine at fit start). A fixed seed keeps checkpoints comparable,
      but 512 sampled tokens are noisy (it dipped 0.45 -> 0.38 while training improved)."""

    def __init__(self, prompts: torch.Tensor, attention_mask: torch.Tensor, tokenizer, *, k: int, temperature: float,
                 top_p: float, top_k: int = 0, max_new_tokens: int = 64, seed: int = 0, log_samples: int = 2,
                 measure_cost: bool = True, on_target_prompts: tuple[torch.Tensor, torch.Tensor] | None = None,
                 on_target_tokens: int = 128, samples_path: Path | None = None, compile: bool = False):
        self.prompts, self.mask, self.tok = prompts, attention_mask, tokenizer
        self.k, self.max_new_tokens, self.seed, self.log_samples = k, max_new_tokens, seed, log_samples
        self.sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k)
        self.measure_cost, self.compile = measure_cost, compile
        self.on_target_prompts, self.on_target_tokens = on_target_prompts, on_target_tokens
        self.samples_path = samples_path
        self.on_target: Batch | None = None
        self.cost = None
        self.history: list[dict] = []

    def _target_samples(self, module) -> Batch:
        """Sampled once per run (resumes reuse the file): the held-out prompts continued by the target."""
        path = self.samples_path
        if path is not None and path.is_file():
            t = load_file(path)
            return Batch(t["ids"], t["mask"], t["loss_mask"].bool())
        t0 = time.perf_counter()
        ids, mask = (t.to(module.device) for t in self.on_target_prompts)
        b = target_samples(module.target, ids, mask, max_new_tokens=self.on_target_tokens,
                           eos_token_id=self.tok.eos_token_id, pad_token_id=self.tok.eos_token_id or 0,
                           seed=self.seed + 1, **self.sampling)
        print(f"draftsmith: val/alpha_on_target set: {len(ids)} prompts x {self.on_target_tokens} tokens "
              f"sampled by the target in {time.perf_counter() - t0:.1f} s", flush=True)
        if path is not None:
            with atomic_path(path) as tmp:
                save_file({"ids": b.ids.cpu(), "mask": b.mask.cpu(), "loss_mask": b.loss_mask.to(torch.uint8).cpu()},
                          tmp)
        return b

    def on_fit_start(self, trainer, module):
        here = self._measures(trainer, module)
        if here:
            module.place_target()
        if here and self.on_target_prompts is not None and self.on_target is None:
            self.on_target = self._target_samples(module)
        if self.measure_cost and self.cost is None:
            # c depends on the draft's shape, not its weights: measure once, in the target's dtype.
            with whole(module):  # collective: every rank enters, the ranks that measure copy
                draft = standalone(module.sampling_draft(), module.target.dtype) if here else None
            if here:
                self.cost = measure_costs(module.target, draft, ks=(self.k,), reps=7, compile=self.compile)
            del draft

    @staticmethod
    def _measures(trainer, module) -> bool:
        """Every rank measures its share, except where only rank 0 holds the target (`module.first_only`)."""
        return not module.first_only or trainer.is_global_zero

    def on_validation_epoch_end(self, trainer, module):
        if trainer.sanity_checking:
            return
        here, first_only = self._measures(trainer, module), module.first_only
        with whole(module):
            gen, metrics = self._measure(trainer, module) if here else (None, None)
            if trainer.is_global_zero:
                self._log_curves(trainer, module, gen, metrics)
        if first_only:  # rank 0's figures on every rank: each logs them, and checkpoints by the same score
            metrics = trainer.strategy.broadcast(metrics, src=0)
        for name, value in metrics.items():  # (after a broadcast every rank's value is rank 0's: the mean is too)
            module.log(name, value, sync_dist=True, prog_bar=name in ("val/alpha", "val/alpha_on_target"))
        self.history.append({"step": trainer.global_step, **metrics})

    def _log_curves(self, trainer, module, gen, metrics):
        """The paper's Figure 1 per validation: acceptance by draft position, and tokens per call by K (measured at
        the sampler's K, expected from alpha at the others); and sample texts."""
        step, alpha = trainer.global_step, metrics["val/alpha"]
        by_k = [[step, k, expected_tokens_per_call(alpha, k), k == self.k] for k in range(1, 9)]
        log_tables(trainer.loggers, step, {
            "val/acceptance_by_position": (["step", "position", "acceptance"],
                                           [[step, i + 1, a] for i, a in enumerate(gen.stats.acceptance_by_position)]),
            "val/tokens_per_call_by_k": (["step", "K", TAU, "measured_k"], by_k)})
        if self.log_samples:
            self._log_samples(trainer, module, module.sampling_draft(), gen)

    def _measure(self, trainer, module):
        """(the sampler's Generation, this validation's figures) with the current draft."""
        dev = module.device
        ids, mask = self.prompts.to(dev), self.mask.to(dev)
        draft = module.sampling_draft()
        gen = speculative_generate(module.target, draft, ids, attention_mask=mask,
                                   max_new_tokens=self.max_new_tokens, k=self.k, compile=self.compile,
                                   generator=seeded(dev, self.seed), **self.sampling)
        s = gen.stats
        metrics = {"val/alpha": s.alpha or 0.0, "val/tokens_per_call": s.tokens_per_call,
                   "val/alpha_sampled_analytic": s.alpha_analytic or 0.0}
        if self.on_target is not None:
            b = self.on_target
            b = Batch(b.ids.to(dev), b.mask.to(dev), b.loss_mask.to(dev))
            metrics["val/alpha_on_target"] = alpha_on_samples(module.target, draft, b,
                                                              SamplingConfig(**self.sampling), k=self.k)
        if self.cost:
            metrics["val/c"] = self.cost["c"]
            metrics["val/predicted_speedup"] = predicted_speedup(s.alpha or 0.0, self.k, self.cost["c"],
                                                                 self.cost["v"][self.k])
        if module.first_only:  # the held-out blocks no other rank can measure
            dl = trainer.val_dataloaders
            metrics.update(module.held_out(dl.dataset, dl.batch_size))
        return gen, {k: float(v) for k, v in metrics.items()}

    def _log_samples(self, trainer, module, draft, gen):
        n = min(self.log_samples, len(self.prompts))
        ids, mask = self.prompts[:n].to(module.device), self.mask[:n].to(module.device)
        own = None
        if not is_feature_draft(draft):  # a feature draft cannot write alone: it reads the target's features
            own = autoregressive_generate(draft, ids, attention_mask=mask, max_new_tokens=self.max_new_tokens,
                                          generator=seeded(module.device, self.seed),
                                          **self.sampling)
        rows = []
        for i in range(n):
            prompt = self.tok.decode(ids[i][mask[i].bool()], skip_special_tokens=True)
            alone = ("(a feature draft: it drafts from the target's features, never alone)" if own is None
                     else self.tok.decode(own.tokens[i], skip_special_tokens=True))
            rows.append([trainer.global_step, prompt, alone, self.tok.decode(gen.tokens[i], skip_special_tokens=True)])
        for lg in trainer.loggers:
            if hasattr(lg, "log_text"):
                lg.log_text(key="val/samples", columns=["step", "prompt", "draft", "target (speculative)"], data=rows)
