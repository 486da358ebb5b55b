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


# -- the cases peers test their rejection samplers with (as vLLM's suite does: drafts against a target's argmax,
# then the sampled case), run against `verify`. Token rows: drafts, then what the step emits.

def _one_hot(tokens: list[list[int]], V: int = 20) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens, dtype=torch.long), V).double()


def _run(drafted: list[list[int]], target: list[list[int]]) -> list[list[int]]:
    """Greedy-style: the draft is sure of its tokens, the target of its own (argmax) at each of K+1 positions.
    Returns each row's emitted tokens: the accepted drafts, then the next token."""
    p, q = _one_hot(drafted), _one_hot(target)
    d = torch.tensor(drafted, dtype=torch.long).reshape(len(drafted), -1)
    n, nxt = verify(p.reshape(len(drafted), d.shape[1], q.shape[-1]), q, d, torch.Generator().manual_seed(0))
    return [row[:k] + [t] for row, k, t in zip(drafted, n.tolist(), nxt.tolist())]


@pytest.mark.parametrize("drafted,target,emitted", [
    ([[1, 2, 3]], [[1, 2, 3, 4]], [[1, 2, 3, 4]]),  # every draft matches: all kept, and the bonus token
    ([[1, 2, 3]], [[1, 5, 3, 4]], [[1, 5]]),  # a mismatch at the second: the target's token there, nothing after
    ([[1, 2, 3]], [[7, 2, 3, 4]], [[7]]),  # at the first
    ([[1, 2], [3, 4]], [[1, 2, 5], [3, 6, 7]], [[1, 2, 5], [3, 6]]),  # rows decided independently
    ([[1]], [[1, 2]], [[1, 2]]),  # one draft token
    ([[1, 2, 3, 4]], [[1, 5, 3, 6, 7]], [[1, 5]]),  # mismatches after the first one are never reached
    ([[]], [[9]], [[9]]),  # nothing drafted: the bonus token alone
    ([[], []], [[9], [8]], [[9], [8]]),
])
def test_peer_cases(drafted, target, emitted):
    assert _run(drafted, target) == emitted


def test_shapes_that_do_not_fit_are_refused():
    p, q = _one_hot([[1, 2]]), _one_hot([[1, 2]])  # q must hold K + 1 positions
    with pytest.raises(ValueError, match=r"q \(B, K\+1, V\)"):
        verify(p, q, torch.tensor([[1, 2]]))


def test_seeded_verification_is_deterministic_and_nothing_drafted_samples_q():
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    p = torch.softmax(torch.randn(64, 3, 9, generator=torch.Generator().manual_seed(1)), -1)
    q = torch.softmax(torch.randn(64, 4, 9, generator=torch.Generator().manual_seed(2)), -1)
    d = torch.multinomial(p.reshape(-1, 9), 1, generator=torch.Generator().manual_seed(3)).reshape(64, 3)
    a, b = verify(p, q, d, g1), verify(p, q, d, g2)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # K = 0: n is 0 and the token is a draw from q at position 0
    N, V = 100_000, 6
    q0 = torch.tensor([0.05, 0.1, 0.3, 0.25, 0.1, 0.2]).expand(N, 1, V)
    n, nxt = verify(q0[:, :0], q0, torch.zeros(N, 0, dtype=torch.long), torch.Generator().manual_seed(0))
    assert int(n.sum()) == 0 and chi2_pvalue(torch.bincount(nxt, minlength=V).double(), q0[0, 0]) > 1e-3
