"""Distillation objectives between draft logits and the frozen target's logits. Pure functions.

Shapes: (N, V) logits for N positions. p = draft, q = target, as in `sampling/`.
Acceptance of a draft token is exactly 1 - TV(p, q) (Chen et al. 2023; DESIGN.md section 2), so `tv` is the
direct objective; but its gradient vanishes where the draft puts no mass, which is everywhere at
initialisation, so a KL term carries the early phase (research/distill_spike.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cross_entropy(draft_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(draft_logits.float(), labels)


def forward_kl(draft_logits, target_logits, temperature: float = 1.0) -> torch.Tensor:
    """KL(q || p): mass-covering; the classic distillation loss."""
    logp = F.log_softmax(draft_logits.float() / temperature, -1)
    logq = F.log_softmax(target_logits.float() / temperature, -1)
    return (logq.exp() * (logq - logp)).sum(-1).mean()


def reverse_kl(draft_logits, target_logits, temperature: float = 1.0) -> torch.Tensor:
    """KL(p || q): mode-seeking."""
    logp = F.log_softmax(draft_logits.float() / temperature, -1)
    logq = F.log_softmax(target_logits.float() / temperature, -1)
    return (logp.exp() * (logp - logq)).sum(-1).mean()


def jsd(draft_logits, target_logits, temperature: float = 1.0, beta: float = 0.5) -> torch.Tensor:
    """Generalised Jensen-Shannon divergence with mixture m = beta p + (1 - beta) q (DistillSpec, GKD)."""
    logp = F.log_softmax(draft_logits.float() / temperature, -1)
    logq = F.log_softmax(target_logits.float() / temperature, -1)
    logm = torch.logsumexp(torch.stack([logp + torch.log(torch.tensor(beta)),
                                        logq + torch.log(torch.tensor(1 - beta))]), 0)
    kl_pm = (logp.exp() * (logp - logm)).sum(-1)
    kl_qm = (logq.exp() * (logq - logm)).sum(-1)
    return (beta * kl_pm + (1 - beta) * kl_qm).mean()


def tv(draft_logits, target_logits, temperature: float = 1.0) -> torch.Tensor:
    """Total variation 1/2 sum |p - q| = 1 - expected acceptance."""
    p = F.softmax(draft_logits.float() / temperature, -1)
    q = F.softmax(target_logits.float() / temperature, -1)
    return 0.5 * (p - q).abs().sum(-1).mean()


DIVERGENCES = {"forward_kl": forward_kl, "reverse_kl": reverse_kl, "jsd": jsd, "tv": tv}


def draft_loss(draft_logits, labels, target_logits, weights: dict[str, float], temperature: float = 1.0):
    """Weighted sum of cross-entropy ('ce') and divergences; returns (total, {name: value})."""
    parts = {}
    if weights.get("ce", 0):
        parts["ce"] = cross_entropy(draft_logits, labels)
    for name, fn in DIVERGENCES.items():
        if weights.get(name, 0):
            if target_logits is None:
                raise ValueError(f"loss '{name}' needs the target's logits: set loss.distill=true")
            parts[name] = fn(draft_logits, target_logits, temperature)
    unknown = set(weights) - {"ce", *DIVERGENCES}
    if unknown:
        raise ValueError(f"unknown loss terms {sorted(unknown)}; choose from ce, {', '.join(DIVERGENCES)}")
    if not parts:
        raise ValueError("all loss weights are zero: give ce or a divergence a positive weight")
    total = sum(weights[k] * v for k, v in parts.items())
    return total, parts
