"""Logits -> the processed distribution that is actually sampled from.

One function for both models and for the baseline: invariant 2 of docs/design.md (temperature, top-k and
top-p applied to draft and target identically) holds because there is only one code path.
Shapes: (..., V) in, (..., V) float32 out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from draftsmith.sampling.errors import DraftsmithError
from draftsmith.sampling.machine import reads_are_free

# Nucleus sampling on a 49k vocabulary: a full sort costs more than a 2-layer draft step on a CPU, and even the
# top 1024 of 64 rows cost a sixth of a batch-64 target step (the top 64: under a third of that). A
# language model's nucleus mostly lies in its top 64; rows whose candidates miss it widen to 1024, then to all.
_TOP_P_CANDIDATES = (64, 1024)


@dataclass(frozen=True)
class SamplingConfig:
    """How logits become a distribution. temperature 0 means greedy (a one-hot distribution)."""

    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off

    def __post_init__(self):
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise DraftsmithError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise DraftsmithError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise DraftsmithError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def process_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """(..., V) logits -> (..., V) float32 probabilities after temperature, top-k, top-p (HF's order)."""
    logits = logits.float()
    V = logits.shape[-1]
    if cfg.greedy:
        return F.one_hot(logits.argmax(-1), V).to(torch.float32)
    if cfg.temperature != 1.0:
        logits = logits / cfg.temperature
    if 0 < cfg.top_k < V:
        kth = logits.topk(cfg.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))  # ties at the k-th value are kept, as in HF
    probs = torch.softmax(logits, dim=-1)
    if cfg.top_p < 1.0:
        probs = _top_p(probs, cfg.top_p)
    return probs


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (the most likely is always kept;
    tokens tied with the least likely kept one are kept too, so the result never depends on sort order)."""
    V = probs.shape[-1]
    flat = probs.reshape(-1, V)
    if not reads_are_free(probs.device):  # an accelerator sorts a vocabulary fast; widening would read back
        threshold = _nucleus_threshold(flat.sort(dim=-1, descending=True).values, top_p)
        kept = flat * (flat >= threshold)
        return (kept / kept.sum(-1, keepdim=True)).reshape(probs.shape)
    rows = threshold = None  # rows: all; then those whose candidates held less than top_p (the nucleus is larger)
    for m in (*(c for c in _TOP_P_CANDIDATES if c < V), V):
        sub = flat if rows is None else flat[rows]
        vals = sub.topk(m, dim=-1).values if m < V else sub.sort(dim=-1, descending=True).values
        if rows is None:
            threshold = _nucleus_threshold(vals, top_p)
        else:
            threshold[rows] = _nucleus_threshold(vals, top_p)
        short = (vals.sum(-1) < top_p).nonzero().squeeze(1)
        if m == V or len(short) == 0:
            break
        rows = short if rows is None else rows[short]
    kept = flat * (flat >= threshold)
    return (kept / kept.sum(-1, keepdim=True)).reshape(probs.shape)


def _nucleus_threshold(vals: torch.Tensor, top_p: float) -> torch.Tensor:
    """(N, m) probabilities sorted descending, holding each row's nucleus -> (N, 1) the least kept probability."""
    before = vals.cumsum(-1) - vals  # mass of the strictly more likely tokens
    n_keep = (before < top_p).sum(-1, keepdim=True)  # >= 1
    return vals.gather(-1, n_keep - 1)


def uniform(shape, generator: torch.Generator | None, dtype: torch.dtype, device) -> torch.Tensor:
    """U[0, 1) of `shape` on `device`, drawn on the generator's own device: a CPU generator (a seed the caller
    made) drives a CUDA model too, where torch.rand would refuse it; a generator on the model's device costs no
    copy. A CPU model with a CPU generator draws exactly as before."""
    where = generator.device if generator is not None else device
    if torch.device(where).type == "cpu" and torch.device(device).type == "cuda":
        # a host generator for a CUDA model: drawn into pinned memory and copied without the host waiting (a plain
        # copy to the device would wait for the device's queue at every draw)
        draw = torch.rand(shape, generator=generator, dtype=dtype, device="cpu", pin_memory=True)
        return draw.to(device, non_blocking=True)
    return torch.rand(shape, generator=generator, dtype=dtype, device=where).to(device)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, V) probabilities -> (B,) token ids, by inverse CDF: one uniform per row.

    torch.multinomial costs ~1 ms on a 49k vocabulary on our CPU, a cumsum + searchsorted ~0.06 ms. Reads nothing
    back from the device.
    """
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    u = uniform((probs.shape[0], 1), generator, cdf.dtype, cdf.device)
    # u * total < total in exact arithmetic; rounded, it may reach total (probability ~2^-24) and land past the last
    # positive entry. Kept strictly below, the index found has cdf[i] > x >= cdf[i-1], so probs[i] > 0: a zero-prob
    # token is never emitted, with no check that would read the draw back
    x = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


@torch.inference_mode()
def sequence_logprob(model, prompt: list[int], tokens: list[int], temperature: float = 1.0) -> float:
    """The model's mean log-probability per token of `tokens` after `prompt` (logits / temperature, in fp32): the
    per-sequence statistic the engines' check and the bench compare speculative against plain samples on."""
    dev = next(model.parameters()).device
    ids = torch.tensor([list(prompt) + list(tokens)], device=dev)
    logits = model(input_ids=ids).logits[0, len(prompt) - 1: -1].float() / max(temperature, 1e-6)
    return float(torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens, device=dev)[:, None]).mean())
