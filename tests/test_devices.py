"""Device-correct by construction: on a GPU node, every tensor, generator and timer that feeds a model takes its device
from that model. The rule enforced here, over `sampling/`, `train/` and `deploy/`: a random draw or a generator is
made with `device=`, or its line says why the CPU is right (`# cpu: ...`): the data order, a probe of the CPU
itself, a seed stream that `probs.uniform` moves to the model's device. Wall-clock timers around model calls go
through `machine.now(device)`, which synchronises CUDA."""

import ast
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
RANDOM = {"Generator", "rand", "randn", "randint", "randperm", "rand_like", "randn_like"}
LIKE = {"rand_like", "randn_like"}  # these take the device of their argument


def offenders(path: Path) -> list[str]:
    lines = path.read_text().splitlines()
    out = []
    for node in ast.walk(ast.parse("\n".join(lines))):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "torch" \
            else None
        if name in RANDOM and name not in LIKE and not any(k.arg == "device" for k in node.keywords):
            span = lines[node.lineno - 1: (node.end_lineno or node.lineno)]
            if not any(re.search(r"#\s*cpu:", ln) for ln in span):
                out.append(f"{path.relative_to(ROOT)}:{node.lineno}: torch.{name}(...) without device=")
        if isinstance(f, ast.Attribute) and f.attr == "perf_counter" and path.parent.name == "sampling" \
                and path.name in ("speculative.py", "cost.py"):
            out.append(f"{path.relative_to(ROOT)}:{node.lineno}: time.perf_counter() in a model loop (use now(dev))")
    return out


def test_every_random_draw_and_generator_names_its_device():
    bad = [o for layer in ("sampling", "train", "deploy") for f in sorted((ROOT / layer).glob("*.py"))
           for o in offenders(f)]
    assert not bad, "\n".join(bad)


def test_the_rule_sees_a_generator_without_a_device(tmp_path):
    f = ROOT / "sampling" / "_planted_check.py"
    try:
        f.write_text("import torch\ng = torch.Generator().manual_seed(0)\nx = torch.rand(3, device='cpu')\n"
                     "y = torch.randint(0, 5, (2,))  # cpu: a planted, explained one\n")
        assert [o.split(": ", 1)[1] for o in offenders(f)] == ["torch.Generator(...) without device="]
    finally:
        f.unlink()


def test_a_cpu_generator_drives_a_model_on_another_device():
    """probs.uniform draws on the generator's device and moves the draw: identical to drawing where the model is
    when both are the CPU; on a meta device (no GPU here) the draw arrives on that device."""
    from draftsmith.sampling.probs import uniform

    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.equal(uniform((2, 3), g1, torch.float32, "cpu"), torch.rand(2, 3, generator=g2))
    assert uniform((2, 3), torch.Generator().manual_seed(0), torch.float32, "meta").device.type == "meta"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.sh runs it on a GPU node)")
def test_sampler_and_costs_on_cuda_with_cpu_inputs():
    """A CUDA target and draft fed CPU prompts and a CPU generator (a user's first call): the sampler runs, greedy
    equals the target's own greedy, and measured costs are synchronised timings."""
    from conftest import tiny_llama

    from draftsmith.sampling import autoregressive_generate, speculative_generate
    from draftsmith.sampling.cost import measure_costs

    target, draft = tiny_llama(vocab=64, seed=0).cuda(), tiny_llama(vocab=64, layers=1, seed=1).cuda()
    ids = torch.tensor([[1, 2, 3]])
    spec = speculative_generate(target, draft, ids, max_new_tokens=16, k=3, temperature=0.0)
    plain = autoregressive_generate(target, ids, max_new_tokens=16, temperature=0.0)
    assert torch.equal(spec.tokens[0].cpu(), plain.tokens[0].cpu())
    sampled = speculative_generate(target, draft, ids, max_new_tokens=16, k=3, temperature=0.8,
                                   generator=torch.Generator().manual_seed(0))
    assert len(sampled.tokens[0]) == 16
    cost = measure_costs(target, draft, ks=(1, 2), reps=3)
    assert cost["c"] > 0 and cost["v"][2] > 0


# -- the stand-in device -------------------------------------------------------------------------------------------
# `meta` behaves as CUDA does toward the host: an op mixing a meta tensor with a CPU one raises ("Tensor on device cpu
# is not on the expected device meta!"), and every read of its values back to the host is refused, as a read of a
# CUDA tensor waits for the device's queue. A path that runs on meta is device-correct; `helpers.DeviceReads` counts
# (and answers with zeros) the reads a path makes, so a loop can run on meta to its end.

def _meta(model):
    return model.to("meta")


@pytest.mark.parametrize("B,temperature,top_p", [(1, 0.0, 1.0), (1, 0.8, 1.0), (3, 0.8, 0.9), (3, 0.0, 1.0)])
@pytest.mark.parametrize("kind", ["independent", "feature", "plain"])
def test_sampler_reads_the_device_once_per_loop(kind, B, temperature, top_p, monkeypatch):
    """On an accelerator every read of the device waits for its queue: the loops read once per loop (the emitted
    tokens), plus once per generation for the prompt's mask and the analytic acceptance. Rows accept different
    numbers of drafts here (the answer to the loop's read), so batches leave holes, masks and compactions."""
    from conftest import tiny_llama
    from helpers import DeviceReads
    from test_feature import feature_draft

    import draftsmith.sampling.speculative as spec
    from draftsmith.sampling import autoregressive_generate, speculative_generate

    monkeypatch.setattr(spec, "HOLE_LOOPS", 0)  # compact at every loop that leaves a hole
    target = tiny_llama(vocab=64, layers=3, seed=0)
    draft = feature_draft(target) if kind == "feature" else tiny_llama(vocab=64, layers=1, seed=1)
    target, draft = _meta(target), _meta(draft)
    ids = torch.randint(0, 64, (B, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, 0] = 0  # a left-padded row

    def answer(name, t):  # the loop's read (n, next token, K drafts): row i accepts i % (K + 1) drafts
        if name == "tolist" and t.dim() == 2 and t.shape[1] > 2:
            return [[i % (t.shape[1] - 1)] + [0] * (t.shape[1] - 1) for i in range(t.shape[0])]
        return None

    kw = dict(attention_mask=mask, max_new_tokens=12, temperature=temperature, top_p=top_p,
              generator=torch.Generator().manual_seed(0))
    with DeviceReads(answer) as reads:
        if kind == "plain":
            gen = autoregressive_generate(target, ids, **kw)
        else:
            gen = speculative_generate(target, draft, ids, k=3, **kw)
    loops = len(gen.stats.loop_end_s) - 1
    assert loops >= 4 and reads.names["tolist"] == loops, reads.names
    assert reads.count <= loops + 2, reads.names  # + the prompt's mask, + the analytic acceptance at the end


def test_k_auto_reads_one_decision_per_drafted_token():
    """k="auto" decides after each drafted token whether to draft one more: one read each, on top of the loop's."""
    from conftest import tiny_llama
    from helpers import DeviceReads

    from draftsmith.sampling import speculative_generate

    target, draft = _meta(tiny_llama(vocab=64, seed=0)), _meta(tiny_llama(vocab=64, layers=1, seed=1))
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(0))
    cost = {"c": 0.05, "v": {1: 1.0, 2: 1.01, 3: 1.02, 4: 1.03}}
    with DeviceReads() as reads:
        gen = speculative_generate(target, draft, ids, max_new_tokens=10, k="auto", k_max=4, cost=cost,
                                   temperature=0.8, generator=torch.Generator().manual_seed(0))
    loops = len(gen.stats.loop_end_s) - 1
    decisions = sum(max(0, K - 1) + (K < 4) for K in gen.stats.k_per_loop)  # after each token but the k_max-th
    assert reads.names["tolist"] == loops and reads.names["__bool__"] <= decisions, reads.names
    assert reads.count <= loops + decisions + 1, reads.names


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 1.0), (0, 0.9), (5, 0.8)])
def test_rejection_math_runs_on_the_stand_in_device(top_k, top_p):
    """Processing, sampling and verification read nothing back: they run on meta as they are."""
    from draftsmith.sampling.probs import SamplingConfig, process_logits, sample
    from draftsmith.sampling.rejection import verify

    cfg = SamplingConfig(0.8, top_k, top_p)
    p = process_logits(torch.randn(2, 3, 50, device="meta"), cfg)
    q = process_logits(torch.randn(2, 4, 50, device="meta"), cfg)
    n, nxt = verify(p, q, torch.zeros(2, 3, dtype=torch.long, device="meta"), torch.Generator().manual_seed(0))
    assert n.device.type == nxt.device.type == sample(q[:, 0]).device.type == "meta"


@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.999])
def test_the_accelerators_top_p_is_the_cpus(top_p, monkeypatch):
    """The CPU widens top-p over candidates (branching on values); an accelerator sorts the vocabulary in one go:
    the same distribution either way, ties included."""
    import draftsmith.sampling.probs as probs

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 3000, generator=g) * torch.linspace(0.5, 6, 16)[:, None]  # flat to peaked rows
    logits[0, :40] = 5.0  # a tie at the nucleus' edge
    cfg = probs.SamplingConfig(1.0, 0, top_p)
    on_cpu = probs.process_logits(logits, cfg)
    monkeypatch.setattr(probs, "reads_are_free", lambda device: False)
    assert torch.equal(probs.process_logits(logits, cfg), on_cpu)


def test_a_draw_never_lands_on_a_zero_probability_token():
    """`sample` keeps u * total strictly below the total: a uniform that rounds up to the total (float rounding)
    still lands on the last token with mass, never on a zero-probability one after it."""
    import draftsmith.sampling.probs as probs

    p = torch.tensor([[0.25, 0.75, 0.0, 0.0]])

    class One:  # a "generator" whose uniform is the largest float below 1, which rounds u * total up to total
        device = torch.device("cpu")

    real = torch.rand
    try:
        torch.rand = lambda shape, generator=None, dtype=None, device=None: torch.full(shape, 1 - 2**-24, dtype=dtype)
        assert int(probs.sample(p, One())) == 1
    finally:
        torch.rand = real
