"""The modified rejection step of speculative sampling (Chen et al. 2023, Algorithm 2). Pure tensor math.

Notation (the paper's, kept everywhere in draftsmith): p = draft distribution, q = target distribution.
A draft token x ~ p is accepted with probability min(1, q(x) / p(x)); at the first rejection the next
token is drawn from norm((q - p)+); if all K are accepted, a bonus token is drawn from q at position K.
Shapes: B rows, K draft tokens, V vocabulary.
"""

from __future__ import annotations

import torch

from draftsmith.sampling.errors import DraftsmithError
from draftsmith.sampling.probs import process_logits, sample, uniform


def acceptance_probability(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """min(1, q(x)/p(x)) for drafted tokens x; p_x > 0 because x was sampled from p."""
    return torch.clamp(q_x / p_x, max=1.0)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm((q - p)+) over the last axis. Where q <= p everywhere (q == p up to rounding) rejection
    has probability ~0, and q itself is the right fallback."""
    r = torch.clamp(q - p, min=0.0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp_min(torch.finfo(r.dtype).tiny), q)


def expected_acceptance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """sum_x min(p(x), q(x)) = 1 - TV(p, q): the probability that a token drawn from p is accepted."""
    return torch.minimum(p, q).sum(-1)


def teacher_forced_acceptance(draft_logits: torch.Tensor, target_logits: torch.Tensor, cfg,
                              columns: torch.Tensor | None = None, chunk: int = 512) -> torch.Tensor:
    """(N,) alpha_analytic of each row: sum_x min(p, q) of draft and target logits (N, ...) after the same
    processing (`cfg`: temperature, top-k, top-p), `chunk` rows at a time (a softmax over a 49k vocabulary at every
    position at once takes gigabytes). `columns`: the draft's logits cover only these tokens (a pruned head), so p is
    zero elsewhere and the target's mass there is never accepted."""
    lp, lq = draft_logits.reshape(-1, draft_logits.shape[-1]), target_logits.reshape(-1, target_logits.shape[-1])
    out = []
    for a, b in zip(lp.split(chunk), lq.split(chunk)):
        p, q = process_logits(a, cfg), process_logits(b, cfg)
        if columns is not None:
            p = p.new_zeros(p.shape[0], q.shape[-1]).index_copy_(-1, columns, p)
        out.append(expected_acceptance(p, q))
    return torch.cat(out) if out else lp.new_zeros(0)


def verify(
    p: torch.Tensor,
    q: torch.Tensor,
    draft_tokens: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One verification of K drafted tokens per row.

    Args:
        p: (B, K, V) draft distributions the draft tokens were sampled from. K = 0 (nothing drafted) is one plain
            step: no draft token, and the bonus token drawn from q at position 0.
        q: (B, K+1, V) target distributions at the same positions plus the bonus position.
        draft_tokens: (B, K) the drafted tokens.

    Returns:
        n_accepted: (B,) number of leading draft tokens accepted, in [0, K].
        next_token: (B,) the token emitted after them: drawn from norm((q - p)+) at the first rejected
            position, or from q at position K (the bonus token) when all K were accepted.
    """
    B, K, _ = p.shape
    if q.shape[:2] != (B, K + 1) or draft_tokens.shape != (B, K):
        raise DraftsmithError(f"verify takes p (B, K, V), q (B, K+1, V) and draft_tokens (B, K); got p "
                              f"{tuple(p.shape)}, q {tuple(q.shape)}, draft_tokens {tuple(draft_tokens.shape)}")
    if K == 0:
        return torch.zeros(B, dtype=torch.long, device=q.device), sample(q[:, 0], generator)
    p_x = p.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # (B, K)
    q_x = q[:, :K].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # (B, K)
    u = uniform((B, K), generator, p.dtype, p.device)
    accepted = u * p_x < q_x  # u < q/p without dividing; accepts with probability min(1, q/p)
    n_accepted = accepted.to(torch.long).cumprod(-1).sum(-1)  # (B,) length of the leading run
    rows = torch.arange(B, device=p.device)
    # After all K accepted, p at position K is taken as zero, so the bonus token is the same formula:
    # residual(0, q_K) = q_K.
    p_n = p[rows, n_accepted.clamp(max=K - 1)] * (n_accepted < K).unsqueeze(-1).to(p.dtype)  # (B, V)
    next_dist = residual(p_n, q[rows, n_accepted])  # (B, V)
    next_token = sample(next_dist, generator)
    return n_accepted, next_token
