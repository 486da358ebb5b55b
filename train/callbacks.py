"""Validation by acceptance measured with the bundled sampler: the only place training calls `sampling/`."""

from __future__ import annotations

import copy

import lightning as L
import torch

from sampling import autoregressive_generate, speculative_generate
from sampling.cost import measure_costs, predicted_speedup


class AcceptanceCallback(L.Callback):
    """At every validation: runs speculative sampling with the current draft on held-out prompts and logs
    `val/alpha`, `val/tokens_per_call` and `val/predicted_speedup` (from alpha and the c and v(K) measured on
    this machine when training starts). A fixed seed per validation keeps checkpoints comparable."""

    def __init__(self, prompts: torch.Tensor, attention_mask: torch.Tensor, tokenizer, *, k: int, temperature: float,
                 top_p: float, top_k: int = 0, max_new_tokens: int = 64, seed: int = 0, log_samples: int = 2,
                 measure_cost: bool = True):
        self.prompts, self.mask, self.tok = prompts, attention_mask, tokenizer
        self.k, self.max_new_tokens, self.seed, self.log_samples = k, max_new_tokens, seed, log_samples
        self.sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k)
        self.measure_cost = measure_cost
        self.cost = None
        self.history: list[dict] = []

    def on_fit_start(self, trainer, module):
        if self.measure_cost and self.cost is None:
            # c depends on the draft's shape, not its weights: measure once, in the target's dtype.
            draft = copy.deepcopy(module.draft).to(module.target.dtype).eval()
            self.cost = measure_costs(module.target, draft, ks=(self.k,), reps=7)
            del draft

    def on_validation_epoch_end(self, trainer, module):
        if trainer.sanity_checking:
            return
        dev = module.device
        ids, mask = self.prompts.to(dev), self.mask.to(dev)
        gen = speculative_generate(module.target, module.draft, ids, attention_mask=mask,
                                   max_new_tokens=self.max_new_tokens, k=self.k,
                                   generator=torch.Generator(device=dev).manual_seed(self.seed), **self.sampling)
        s = gen.stats
        metrics = {"val/alpha": s.alpha or 0.0, "val/tokens_per_call": s.tokens_per_call,
                   "val/alpha_sampled_analytic": s.alpha_analytic or 0.0}
        if self.cost:
            metrics["val/c"] = self.cost["c"]
            metrics["val/predicted_speedup"] = predicted_speedup(s.alpha or 0.0, self.k, self.cost["c"],
                                                                 self.cost["v"][self.k])
        for name, value in metrics.items():
            module.log(name, float(value), sync_dist=True, prog_bar=name in ("val/alpha",))
        self.history.append({"step": trainer.global_step, **{k: float(v) for k, v in metrics.items()}})
        if self.log_samples and trainer.is_global_zero:
            self._log_samples(trainer, module, gen)

    def _log_samples(self, trainer, module, gen):
        n = min(self.log_samples, len(self.prompts))
        ids, mask = self.prompts[:n].to(module.device), self.mask[:n].to(module.device)
        own = autoregressive_generate(module.draft, ids, attention_mask=mask, max_new_tokens=self.max_new_tokens,
                                      generator=torch.Generator(device=module.device).manual_seed(self.seed),
                                      **self.sampling)
        rows = []
        for i in range(n):
            prompt = self.tok.decode(ids[i][mask[i].bool()], skip_special_tokens=True)
            rows.append([trainer.global_step, prompt, self.tok.decode(own.tokens[i], skip_special_tokens=True),
                         self.tok.decode(gen.tokens[i], skip_special_tokens=True)])
        for lg in trainer.loggers:
            if hasattr(lg, "log_text"):
                lg.log_text(key="val/samples", columns=["step", "prompt", "draft", "target (speculative)"], data=rows)
