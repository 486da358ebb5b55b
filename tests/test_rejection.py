"""The rejection step's algebra, exactly, and its sampling, statistically (docs/design.md invariant 6)."""

import pytest
import torch
from helpers import chi2_pvalue

from draftsmith.sampling.rejection import acceptance_probability, expected_acceptance, residual, verify


def pairs():
    g = torch.Generator().manual_seed(0)
    V = 7
    rand = lambda: torch.softmax(torch.randn(V, generator=g, dtype=torch.float64) * 2, -1)  # noqa: E731
    one_hot = lambda i: torch.nn.functional.one_hot(torch.tensor(i), V).double()  # noqa: E731
    q = rand()
    yield "equal", q, q.clone()
    yield "random", rand(), rand()
    yield "disjoint", torch.tensor([.5, .5, 0, 0, 0, 0, 0]).double(), torch.tensor([0, 0, .2, .2, .2, .2, .2]).double()
    yield "one_hot_draft", one_hot(3), rand()
    yield "one_hot_both_differ", one_hot(1), one_hot(2)
    yield "q_zero_where_p_positive", rand(), torch.tensor([0, 0, 0, .5, .5, 0, 0]).double()


@pytest.mark.parametrize("name,p,q", list(pairs()), ids=[n for n, *_ in pairs()])
def test_accept_then_residual_reproduces_q_exactly(name, p, q):
    """P(emit y) = p(y) min(1, q(y)/p(y)) + (1 - sum_x min(p, q)) * residual(y) must equal q(y)."""
    accept = torch.where(p > 0, p * acceptance_probability(p.clamp_min(1e-300), q), torch.zeros_like(p))
    emitted = accept + (1 - expected_acceptance(p, q)) * residual(p, q)
    assert torch.allclose(emitted, q, atol=1e-12), (emitted, q)


def test_verify_first_token_is_distributed_as_q():
    """K=1 verify over 200k rows: the first emitted token ~ q (chi-square), acceptance ~ sum min(p,q)."""
    g = torch.Generator().manual_seed(0)
    V, N = 6, 200_000
    p = torch.tensor([0.4, 0.3, 0.1, 0.1, 0.1, 0.0])
    q = torch.tensor([0.05, 0.1, 0.3, 0.25, 0.1, 0.2])
    x = torch.multinomial(p, N, replacement=True, generator=g)
    P, Q = p.expand(N, 1, V), q.expand(N, 2, V)
    n, nxt = verify(P, Q, x[:, None], g)
    first = torch.where(n >= 1, x, nxt)
    counts = torch.bincount(first, minlength=V).double()
    assert chi2_pvalue(counts, q) > 1e-3
    assert abs(n.float().mean().item() - expected_acceptance(p, q).item()) < 4 * (0.25 / N) ** 0.5
    # after an acceptance the bonus token is an independent draw from q at position 1
    bonus = nxt[n == 1]
    assert chi2_pvalue(torch.bincount(bonus, minlength=V), q) > 1e-3


def test_verify_accepts_prefix_only():
    """The accepted count is the length of the leading run: a rejection stops the block."""
    p = torch.tensor([[[1.0, 0, 0], [0, 1.0, 0], [1.0, 0, 0]]])  # drafts 0, 1, 0
    q = torch.tensor([[[1.0, 0, 0], [0, 0, 1.0], [1.0, 0, 0], [0, 1.0, 0]]])  # rejects position 1
    n, nxt = verify(p, q, torch.tensor([[0, 1, 0]]))
    assert n.item() == 1 and nxt.item() == 2
    q_all = torch.tensor([[[1.0, 0, 0], [0, 1.0, 0], [1.0, 0, 0], [0, 0, 1.0]]])
    n, nxt = verify(p, q_all, torch.tensor([[0, 1, 0]]))
    assert n.item() == 3 and nxt.item() == 2  # bonus token from q at position K
