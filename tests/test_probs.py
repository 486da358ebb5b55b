import pytest
import torch

from draftsmith.sampling.probs import SamplingConfig, process_logits


def reference(logits, t, k, p):
    """A slow, obviously-correct reference: per row, in Python."""
    out = []
    for row in logits.double():
        if t == 0:
            r = torch.zeros_like(row)
            r[row.argmax()] = 1
            out.append(r)
            continue
        z = row / t
        if k:
            kth = sorted(z.tolist(), reverse=True)[k - 1]
            z = torch.where(z < kth, torch.tensor(float("-inf"), dtype=z.dtype), z)
        pr = torch.softmax(z, -1)
        if p < 1:
            order = sorted(range(len(pr)), key=lambda i: -pr[i].item())
            keep, mass = [], 0.0
            for i in order:
                if mass >= p:
                    break
                keep.append(i)
                mass += pr[i].item()
            mask = torch.zeros_like(pr, dtype=torch.bool)
            mask[keep] = True
            pr = torch.where(mask, pr, torch.zeros_like(pr))
            pr = pr / pr.sum()
        out.append(pr)
    return torch.stack(out).float()


@pytest.mark.parametrize("t,k,p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 3, 1.0), (0.8, 0, 0.9), (1.0, 5, 0.5),
                                   (0.0, 0, 1.0), (2.0, 1, 1.0), (1.0, 0, 0.01)])
def test_processing_matches_reference(t, k, p):
    logits = torch.randn(6, 11, generator=torch.Generator().manual_seed(1)) * 3
    got = process_logits(logits, SamplingConfig(t, k, p))
    torch.testing.assert_close(got, reference(logits, t, k, p), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got.sum(-1), torch.ones(6))


def test_top_p_candidate_tiers_equal_the_full_sort_on_large_vocab():
    """The top-64 and top-1024 candidate paths and the full-sort fallback give the same distribution, alone and
    mixed in one batch (each row widens only as far as its nucleus needs)."""
    g = torch.Generator().manual_seed(0)
    V = 49152

    def nucleus_of(n):  # rows whose nucleus at T 0.8, top-p 0.95 holds about n tokens
        logits = torch.randn(2, V, generator=g) * 0.01 - 30.0
        logits[:, :n] += 30.0
        return logits

    small, middle, flat = nucleus_of(20), nucleus_of(400), torch.randn(2, V, generator=g) * 0.01
    mixed = torch.stack([small[0], flat[0], middle[0], small[1], flat[1], middle[1]])
    for logits in (small, middle, flat, mixed, mixed.view(2, 3, -1)):
        got = process_logits(logits, SamplingConfig(0.8, 0, 0.95)).reshape(-1, V)
        logits = logits.reshape(-1, V)
        torch.testing.assert_close(got, reference(logits, 0.8, 0, 0.95), atol=1e-6, rtol=1e-4)
    sizes = (process_logits(mixed, SamplingConfig(0.8, 0, 0.95)) > 0).sum(-1).tolist()
    assert all(s <= 64 for s in sizes[0::3]) and 64 < min(sizes[2::3]) and max(sizes[2::3]) <= 1024
    assert min(sizes[1::3]) > 1024  # every tier was taken


def test_top_k_keeps_ties_like_hf():
    logits = torch.tensor([[2.0, 2.0, 1.0, 0.0]])
    probs = process_logits(logits, SamplingConfig(1.0, 1, 1.0))
    assert probs[0, 0] == probs[0, 1] == 0.5


@pytest.mark.parametrize("kwargs,msg", [(dict(temperature=-0.1), "temperature"), (dict(top_k=-1), "top_k"),
                                        (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p")])
def test_bad_sampling_settings_are_refused(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingConfig(**kwargs)
