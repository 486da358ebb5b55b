"""Measured costs for the speed-up model of DESIGN.md section 2, on the machine at hand.

c    = cost of one draft step / cost of one target step (1 new token each, KV cache warm)
v(K) = cost of one target pass over K+1 new tokens / cost of a 1-token pass
"""

from __future__ import annotations

import statistics
import time

import torch
from transformers import DynamicCache


def _step_ms(model, context: torch.Tensor, new_tokens: int, reps: int) -> float:
    """Median ms of a forward over `new_tokens` tokens after a cached `context`, cropping back each time."""
    cache = DynamicCache(config=model.config)
    model(input_ids=context, cache=cache, use_cache=True, logits_to_keep=1)
    L = context.shape[1]
    block = context[:, :new_tokens]
    pos = torch.arange(L, L + new_tokens)[None]
    times = []
    for _ in range(reps + 2):
        t = time.perf_counter()
        model(input_ids=block, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=new_tokens)
        times.append(time.perf_counter() - t)
        cache.crop(-new_tokens)
    return 1e3 * statistics.median(times[2:])


@torch.inference_mode()
def measure_costs(target, draft, ks=(1, 2, 3, 4, 5, 6, 7, 8), context_len: int = 200, reps: int = 15,
                  seed: int = 0) -> dict:
    """{'c', 'target_ms', 'draft_ms', 'v': {K: v(K)}} measured interleaved, medians of `reps` calls."""
    g = torch.Generator().manual_seed(seed)
    V = target.config.vocab_size
    context = torch.randint(0, V, (1, context_len), generator=g)
    target_ms = _step_ms(target, context, 1, reps)
    draft_ms = _step_ms(draft, context, 1, reps)
    target_ms = min(target_ms, _step_ms(target, context, 1, reps))  # re-measure: the first pays warm-up
    v = {int(k): _step_ms(target, context, k + 1, reps) / target_ms for k in ks}
    return {"c": draft_ms / target_ms, "target_ms": target_ms, "draft_ms": draft_ms, "v": v,
            "context_len": context_len}


def expected_tokens_per_call(alpha: float, k: int) -> float:
    """(1 - alpha^(K+1)) / (1 - alpha): tokens per loop with i.i.d. acceptance."""
    return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def predicted_speedup(alpha: float, k: int, c: float, v: float = 1.0) -> float:
    """(1 - alpha^(K+1)) / ((1 - alpha) (K c + v(K))), Chen et al. 2023 with the measured verify cost v(K)."""
    return expected_tokens_per_call(alpha, k) / (k * c + v)


def best_k(alpha: float, c: float, v: dict[int, float]) -> tuple[int, float]:
    """The K that maximises the predicted speed-up over the measured v(K)."""
    return max(((k, predicted_speedup(alpha, k, c, vk)) for k, vk in v.items()), key=lambda kv: kv[1])
