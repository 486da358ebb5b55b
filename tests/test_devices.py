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
