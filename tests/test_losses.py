import pytest
import torch

from draftsmith.sampling.probs import SamplingConfig, process_logits
from draftsmith.sampling.rejection import expected_acceptance
from draftsmith.train import losses


@pytest.fixture
def logits():
    g = torch.Generator().manual_seed(0)
    return torch.randn(16, 50, generator=g) * 3, torch.randn(16, 50, generator=g) * 3


@pytest.mark.parametrize("name", sorted(losses.DIVERGENCES))
def test_divergence_is_zero_on_equal_and_positive_otherwise(logits, name):
    d, t = logits
    fn = losses.DIVERGENCES[name]
    assert fn(t, t).item() == pytest.approx(0.0, abs=1e-6)
    assert fn(d, t).item() > 0.01


@pytest.mark.parametrize("compile", [False, True])
def test_fused_divergences_equal_the_reference_functions(logits, compile):
    d, t = logits
    names = tuple(sorted(losses.DIVERGENCES))
    fused = losses.divergences(d, t, 0.8, names, compile=compile)
    assert not compile or losses._compiled is not losses._fused  # compiled, not the silent eager fallback
    for n in names:
        torch.testing.assert_close(fused[n], losses.DIVERGENCES[n](d, t, 0.8), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("compile", [False, True])
def test_row_weights_give_the_weighted_mean_of_every_term(logits, compile):
    # the feature draft's unrolled steps (step s weighs step_decay ** s): a weight of 2 on a row counts it twice, a
    # weight of 0 drops it, and ce skips ignored labels in the weights as the plain mean does
    d, t = logits
    labels = torch.arange(16) % 50
    labels[3] = -100
    w = torch.ones(16)
    w[:4], w[10:] = 2.0, 0.0
    names = {n: 1.0 for n in losses.DIVERGENCES} | {"ce": 1.0}
    _, got = losses.draft_loss(d, labels, t, names, 0.8, compile=compile, row_weights=w)
    assert not compile or losses._compiled is not losses._fused  # compiled, not the silent eager fallback
    rows = [0, 0, 1, 1, 2, 2, 3, 3, 4, 5, 6, 7, 8, 9]  # rows 0-3 twice, 4-9 once, 10-15 never
    _, want = losses.draft_loss(d[rows], labels[rows], t[rows], names, 0.8, compile=False)
    for n in names:
        torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-5)


def test_tv_is_one_minus_the_samplers_acceptance(logits):
    d, t = logits
    cfg = SamplingConfig(0.8)
    acc = expected_acceptance(process_logits(d, cfg), process_logits(t, cfg)).mean()
    assert losses.tv(d, t, 0.8).item() == pytest.approx(1 - acc.item(), abs=1e-5)


def test_gradient_flows_to_the_draft_only(logits):
    d, t = logits
    d = d.clone().requires_grad_(True)
    t = t.clone().requires_grad_(True)
    total, parts = losses.draft_loss(d, torch.zeros(16, dtype=torch.long), t.detach(), {"tv": 1.0, "ce": 0.5},
                                     compile=False)
    total.backward()
    assert d.grad is not None and d.grad.abs().sum() > 0 and t.grad is None
    assert set(parts) == {"tv", "ce"}


@pytest.mark.parametrize("weights,msg", [({"nope": 1.0}, "unknown"), ({"ce": 0.0}, "zero"), ({"tv": 1.0}, "distill")])
def test_bad_loss_config_is_refused(logits, weights, msg):
    d, _ = logits
    with pytest.raises(ValueError, match=msg):
        losses.draft_loss(d, torch.zeros(16, dtype=torch.long), None, weights)


def test_the_teacher_cache_asks_the_target_once_per_block_and_keeps_its_distribution():
    from draftsmith.data.teacher import TeacherCache

    g = torch.Generator().manual_seed(1)
    true = torch.randn(4, 6, 50, generator=g) * 3  # 4 blocks, 6 label positions, V 50
    asked = []

    def teacher(rows):
        def f(miss):
            asked.append(rows[miss].tolist())
            return true[rows[miss]]
        return f

    cache = TeacherCache(4, 6, 8, 50)
    first = cache.logits(torch.tensor([0, 2]), teacher(torch.tensor([0, 2])))
    second = cache.logits(torch.tensor([2, 3]), teacher(torch.tensor([2, 3])))
    third = cache.logits(torch.tensor([3, 0]), teacher(torch.tensor([3, 0])))
    assert asked == [[0, 2], [3]]  # block 2 and then both blocks came from the cache
    assert (cache.hits, cache.misses) == (3, 3)
    torch.testing.assert_close(second[0], first[1], rtol=0, atol=0)  # a later visit sees what the first saw
    torch.testing.assert_close(third, torch.stack([second[1], first[0]]), rtol=0, atol=0)
    # the kept top-k have the target's probabilities, the rest its exact tail mass spread evenly
    p, q = true[[0, 2]].softmax(-1), first.softmax(-1)
    top = p.topk(8, -1)
    torch.testing.assert_close(q.gather(-1, top.indices), top.values, rtol=2e-3, atol=1e-4)
    torch.testing.assert_close(q.sum(-1) - q.gather(-1, top.indices).sum(-1), 1 - top.values.sum(-1),
                               rtol=0, atol=1e-3)  # fp16 rounding of the kept entries
    for name in losses.DIVERGENCES:  # finite for every divergence, reverse KL included
        assert torch.isfinite(losses.DIVERGENCES[name](true[[0, 2]].flatten(0, 1), first.flatten(0, 1)))
    with pytest.raises(ValueError, match="teacher_topk"):
        TeacherCache(4, 6, 50, 50)
