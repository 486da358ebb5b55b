"""Measured costs for the speed-up model of docs/design.md, on the machine at hand.

c    = cost of one draft step / cost of one target step (1 new token each, KV cache warm)
v(K) = cost of one target pass over K+1 new tokens / cost of a 1-token pass
"""

from __future__ import annotations

import statistics

import torch
from transformers import DynamicCache

from draftsmith.sampling.compiled import StaticDecoder
from draftsmith.sampling.feature import is_feature_draft
from draftsmith.sampling.machine import device_of, now


class Stepper:
    """A model with a warm KV cache over `context`; each call times one forward over `n` new tokens, then crops.
    compile: the compiled static-shape step the sampler runs with compile=True (`sampling/compiled.py`)."""

    def __init__(self, model, context: torch.Tensor, compile: bool = False):
        self.dev = device_of(model)
        self.model, self.context = model, context.to(self.dev)
        context = self.context
        self.extra = lambda n: {}
        arange = lambda a, b: torch.arange(a, b, device=self.dev)[None]  # noqa: E731
        self.positions = arange
        self.static = StaticDecoder(model, context.shape[1] + 16) if compile else None
        if self.static is not None:
            L = context.shape[1]
            self.static(context, arange(0, L), torch.ones(1, L, dtype=torch.bool, device=self.dev), 1)
            return
        if is_feature_draft(model):  # a drafting step reads its own previous output (width H) as the feature
            width = model.config.hidden_size
            self.extra = lambda n: {"features": torch.randn(1, n, width, dtype=model.dtype, device=self.dev)}
            self.cache = model.new_cache()
        else:
            self.cache = DynamicCache(config=model.config)
        L = context.shape[1]
        model(input_ids=context, position_ids=arange(0, L), cache=self.cache, use_cache=True,
              logits_to_keep=1, **self.extra(L))

    def __call__(self, n: int) -> float:
        L = self.context.shape[1]
        if self.static is not None:
            t = now(self.dev)
            self.static(self.context[:, :n], self.positions(L, L + n), torch.ones(1, n, dtype=torch.bool,
                                                                                 device=self.dev), n)
            dt = now(self.dev) - t
            rejected = torch.zeros(1, n, dtype=torch.bool)
            self.static.settle(rejected.to(self.dev), rejected)
            return dt
        extra = self.extra(n)
        t = now(self.dev)
        self.model(input_ids=self.context[:, :n], position_ids=self.positions(L, L + n), cache=self.cache,
                   use_cache=True, logits_to_keep=n, **extra)
        dt = now(self.dev) - t
        self.cache.crop(-n)
        return dt


@torch.inference_mode()
def measure_costs(target, draft, ks=(1, 2, 3, 4, 5, 6, 7, 8), context_len: int = 200, reps: int = 15,
                  seed: int = 0, compile: bool = False) -> dict:
    """{'c', 'target_ms', 'draft_ms', 'v': {K: v(K)}}. compile: the costs of the compiled steps (each shape is
    compiled by the warm-up, outside the timing).

    Each repetition times, back to back, a 1-token target step, a 1-token draft step and a (K+1)-token target
    pass per K; c and v(K) are medians of the per-repetition ratios, so a burst of load on a shared machine
    shifts numerator and denominator together instead of biasing one of them.
    """
    # the same context on any device for a seed: drawn on the CPU, moved to each model's device by Stepper
    g = torch.Generator(device="cpu").manual_seed(seed)
    context = torch.randint(0, target.config.vocab_size, (1, context_len), generator=g, device="cpu")
    tgt, drf = Stepper(target, context, compile), Stepper(draft, context, compile)
    for _ in range(2):  # warm-up (compiled: every shape compiles here, outside the timing)
        tgt(1), drf(1)
        for k in ks if compile else ():
            tgt(k + 1)
    t1, d1, ratios_c, ratios_v = [], [], [], {int(k): [] for k in ks}
    for _ in range(reps):
        t, d = tgt(1), drf(1)
        t1.append(t)
        d1.append(d)
        ratios_c.append(d / t)
        for k in ratios_v:
            ratios_v[k].append(tgt(k + 1) / tgt(1))
    med = statistics.median
    return {"c": med(ratios_c), "target_ms": 1e3 * med(t1), "draft_ms": 1e3 * med(d1),
            "v": {k: med(r) for k, r in ratios_v.items()}, "context_len": context_len}


def expected_tokens_per_call(alpha: float, k: int) -> float:
    """(1 - alpha^(K+1)) / (1 - alpha): tokens per loop with i.i.d. acceptance."""
    return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def predicted_speedup(alpha: float, k: int, c: float, v: float = 1.0) -> float:
    """(1 - alpha^(K+1)) / ((1 - alpha) (K c + v(K))), Chen et al. 2023 with the measured verify cost v(K)."""
    return expected_tokens_per_call(alpha, k) / (k * c + v)


def best_k(alpha: float, c: float, v: dict[int, float]) -> tuple[int, float]:
    """The K that maximises the predicted speed-up over the measured v(K)."""
    return max(((k, predicted_speedup(alpha, k, c, vk)) for k, vk in v.items()), key=lambda kv: kv[1])
