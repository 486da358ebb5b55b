"""Device-correct by construction: on a GPU node, every tensor, generator and timer that feeds a model takes its device
from that model. The rule enforced here, over `sampling/`, `train/` and `deploy/`: a random draw or a generator is
made with `device=`, or its line says why the CPU is right (`# cpu: ...`): the data order, a probe of the CPU
itself, a seed stream that `probs.uniform` moves to the model's device. Wall-clock timers around model calls go
through `machine.now(device)`, which synchronises CUDA."""

import ast
import os
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
    bad = [o for layer in ("sampling", "engines", "train", "deploy") for f in sorted((ROOT / layer).glob("*.py"))
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.sh runs it on a GPU node)")
@pytest.mark.parametrize("generator", ["cuda", "cpu"])
def test_the_loops_wait_for_the_gpu_once_per_loop(generator):
    """CUDA's own sync debug mode warns at every operation that makes the host wait for the GPU: the speculative
    loop waits once per loop (its one read), plus a number of times per generation (the prompt's mask, the rows'
    tokens, the analytic acceptance at the end, and host-to-device copies the debug mode also counts), with a
    generator on the GPU or on the host (its draws copied over through pinned memory). The per-loop part is what
    is bounded: two generations of different lengths differ by at most one wait per loop, plus the copy made when
    a row finishes before the other. The per-generation constant is printed (scripts/gpu_check.sh shows it) for the
    first GPU run to settle, not guessed."""
    import warnings

    from conftest import tiny_llama

    from draftsmith.sampling import speculative_generate
    from draftsmith.sampling.machine import seeded

    target, draft = tiny_llama(vocab=64, seed=0).cuda(), tiny_llama(vocab=64, layers=1, seed=1).cuda()
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, 0] = 0
    g = seeded("cuda", 0) if generator == "cuda" else torch.Generator().manual_seed(0)
    speculative_generate(target, draft, ids, attention_mask=mask, max_new_tokens=4, k=2, temperature=0.8, generator=g)
    torch.cuda.synchronize()

    def counted(max_new_tokens):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                gen = speculative_generate(target, draft, ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                           k=3, temperature=0.8, top_p=0.95, generator=g)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        waits = [str(w.message).splitlines()[0] for w in seen if "synchroniz" in str(w.message)]
        return waits, len(gen.stats.loop_end_s) - 1

    (short, short_loops), (long, long_loops) = counted(8), counted(40)
    print(f"host reads ({generator} generator): {len(short)} waits in {short_loops} loops, {len(long)} waits in "
          f"{long_loops} loops: {len(long) - len(short)} more waits for {long_loops - short_loops} more loops, "
          f"{len(short) - short_loops} per generation")
    assert long_loops > short_loops
    # `_Rows.keep` (sampling/speculative.py) copies the live rows' index from the host to the device when a row
    # finishes a loop before the others: a blocking copy the debug mode counts, at most once per row but the last
    # (whose finish ends the generation). The 40-token run often has it and the 8-token run often not, so the
    # difference may exceed one wait per loop by exactly those copies; the meta stand-in never counts a copy.
    finished_row_copies = ids.shape[0] - 1
    assert len(long) - len(short) <= long_loops - short_loops + finished_row_copies, long[:8]


# -- the stand-in device -------------------------------------------------------------------------------------------
# `meta` behaves as CUDA does toward the host: an op mixing a meta tensor with a CPU one raises ("Tensor on device cpu
# is not on the expected device meta!"), and every read of its values back to the host is refused, as a read of a
# CUDA tensor waits for the device's queue. A path that runs on meta is device-correct; `helpers.DeviceReads` counts
# (and answers with zeros) the reads a path makes, so a loop can run on meta to its end.

def _meta(model):
    return model.to("meta")


STAND_IN_ONLY = pytest.mark.skipif(os.environ.get("DRAFTSMITH_TEST_DEVICE", "meta") != "meta",
                                   reason="counts reads on the meta stand-in; on CUDA its sync debug mode counts them")


@STAND_IN_ONLY
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


@STAND_IN_ONLY
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
    """`sample` keeps u * total strictly below the total: a draw where u * total reaches the total (float rounding,
    or a uniform of exactly 1.0, which some backends' uniform can return) still lands on the last token with mass,
    never on a zero-probability one after it. (Without the guard, x = total finds index 4, clamped to 3: p = 0.)"""
    import draftsmith.sampling.probs as probs

    p = torch.tensor([[0.25, 0.75, 0.0, 0.0]])

    class One:  # a "generator" whose uniform is 1.0, so that u * total is the total itself
        device = torch.device("cpu")

    real = torch.rand
    try:
        # u = 1 - 2**-24 (the largest float32 below 1) never rounds 1.0 up, and the test then passed without the guard
        torch.rand = lambda shape, generator=None, dtype=None, device=None: torch.ones(shape, dtype=dtype)
        assert int(probs.sample(p, One())) == 1
    finally:
        torch.rand = real


# -- training and reporting on the stand-in device -------------------------------------------------------------------
# Every path that takes a model, with the model on `meta` (DRAFTSMITH_TEST_DEVICE=cuda runs them on a GPU instead:
# scripts/gpu_check.sh): a host tensor meeting it raises there, as it would on a GPU. Reads of its values are answered
# by `DeviceReads` (zeros), so a path runs to its end.

DEVICE = os.environ.get("DRAFTSMITH_TEST_DEVICE", "meta")


def _models(vocab=64, hidden=32, layers=4):
    from conftest import tiny_llama

    target = tiny_llama(vocab=vocab, layers=layers, hidden=hidden, seed=0).to(DEVICE)
    return target


def _on(t) -> str:
    return torch.device(t.device if isinstance(t, torch.Tensor) else next(t.parameters()).device).type


def test_drafts_are_built_where_the_target_is():
    """build_draft (target_init copies the target's layers), the cut-target baseline and a pruned head's rows all
    land on the target's device: built on the host beside a target on a GPU they crashed at fit start."""
    from draftsmith.drafts.build import DraftConfig, build_draft, truncated_target
    from draftsmith.sampling.pruned import PrunedHeadDraft

    target = _models()
    draft = build_draft(target, DraftConfig(layers=2, width_ratio=1.0, init="target"))
    assert _on(draft) == DEVICE and next(draft.parameters()).dtype == torch.float32
    cut = truncated_target(target, 2)
    assert _on(cut) == DEVICE and next(cut.parameters()).dtype == next(target.parameters()).dtype
    pruned = PrunedHeadDraft(draft, torch.tensor([3, 1, 7]))  # ids from the host, as a run's token counts are
    assert _on(pruned.head.weight) == _on(pruned.token_ids) == DEVICE
    out = pruned(input_ids=torch.zeros(1, 4, dtype=torch.long, device=DEVICE))
    assert _on(out.sub_logits) == _on(out.logits) == DEVICE


def test_one_rank_builds_its_draft_from_the_target_it_holds_on_the_device(tmp_path):
    """One rank holding the whole target on an accelerator, in its files' dtype, builds the draft from it (the same
    bytes, no second read of the files on the host); several ranks, a host target, a cast target or one spread over
    GPUs read the files, so every rank starts from the same draft."""
    from types import SimpleNamespace

    from draftsmith.drafts.build import DraftConfig, TargetWeights
    from draftsmith.train.draft_init import built_on_device, initial_draft

    from conftest import tiny_llama

    host = tiny_llama(vocab=64, layers=4, hidden=32, seed=0)
    host.save_pretrained(tmp_path / "t")
    weights = TargetWeights.of(str(tmp_path / "t"))
    assert weights.dtype == torch.float32
    on_device = tiny_llama(vocab=64, layers=4, hidden=32, seed=0).to(DEVICE)  # (.to moves a module in place)
    assert built_on_device(on_device, weights, one_rank=True) is (DEVICE != "cpu")
    assert not built_on_device(on_device, weights, one_rank=False)
    assert not built_on_device(host, weights, one_rank=True)
    assert not built_on_device(tiny_llama(vocab=64, layers=4, hidden=32).to(DEVICE, torch.bfloat16), weights,
                               one_rank=True)
    on_device.hf_device_map = {"model": 0}
    assert not built_on_device(on_device, weights, one_rank=True)
    del on_device.hf_device_map
    # the entry's step: the draft lands beside the target, built from it
    cfg = SimpleNamespace(data=SimpleNamespace())
    draft, head, _ = initial_draft(cfg, DraftConfig(layers=2, width_ratio=1.0, init="target"), None,
                                   SimpleNamespace(token_counts=None), weights, on_device, None, one_rank=True)
    assert _on(draft) == DEVICE and head is None


def test_a_feature_draft_is_built_where_the_target_is():
    from draftsmith.drafts.feature import build_feature_draft

    target = _models()
    counts = torch.arange(64.0)
    draft = build_feature_draft(target, draft_vocab=16, token_counts=counts,
                                probe=torch.zeros(2, 8, dtype=torch.long))  # a host probe, as a run's blocks
    assert _on(draft) == DEVICE and _on(draft.d2t) == DEVICE


def test_the_feature_tap_concatenates_a_target_split_over_two_devices():
    """target.device_map=auto puts layers on several GPUs: the tap's three states live on different devices and
    land on the one asked for (the draft's). Layers 0-1 stay on the host, 2-3 go to the stand-in device."""
    from conftest import tiny_llama

    from draftsmith.sampling.feature import FeatureTap

    target = tiny_llama(vocab=64, layers=4, hidden=32, seed=0)
    split = [*target.model.layers[2:], target.model.norm, target.lm_head]
    for m in split:
        m.to(DEVICE)

        def onto(module, args, kwargs, dev=DEVICE):  # what accelerate's hooks do between a spread model's layers
            move = lambda x: x.to(dev) if isinstance(x, torch.Tensor) else x  # noqa: E731
            return tuple(map(move, args)), {k: tuple(map(move, v)) if isinstance(v, tuple) else move(v)
                                            for k, v in kwargs.items()}
        m.register_forward_pre_hook(onto, with_kwargs=True)
    with FeatureTap(target, [0, 1, 3], device=DEVICE) as tap:
        target(input_ids=torch.zeros(1, 5, dtype=torch.long))
        feats = tap.take()
    assert _on(feats) == DEVICE and feats.shape == (1, 5, 3 * 32)


@pytest.mark.filterwarnings("ignore:for .* copying from a non-meta parameter")  # meta keeps no values
def test_a_sharded_drafts_checkpoint_is_rebuilt_where_it_will_run(tmp_path):
    from conftest import tiny_llama

    from draftsmith.drafts.saved import draft_from_checkpoint

    draft = tiny_llama(vocab=64, layers=1, seed=1)
    torch.save({"state_dict": {f"draft.{k}": v for k, v in draft.state_dict().items()}}, tmp_path / "last.ckpt")
    rebuilt = draft_from_checkpoint(draft, str(tmp_path / "last.ckpt"), rebuild=True, device=DEVICE)
    copied = draft_from_checkpoint(draft, str(tmp_path / "last.ckpt"), device=DEVICE)
    assert _on(rebuilt) == _on(copied) == DEVICE


@pytest.mark.parametrize("kind", ["pruned", "feature"])
def test_a_bundles_draft_loads_back_onto_the_device(kind, tmp_path):
    """A draft as export writes it (a pruned head's token ids beside it; a feature draft's own format), loaded onto
    the device: the head `load_model` wraps it in is built there too."""
    from test_feature import feature_draft

    from draftsmith.drafts.saved import save_draft
    from draftsmith.sampling.load import load_model
    from draftsmith.sampling.pruned import PrunedHeadDraft

    tok = pytest.importorskip("transformers").AutoTokenizer.from_pretrained(_tiny_random_dir())
    if kind == "pruned":
        from conftest import tiny_llama

        save_draft(tiny_llama(vocab=len(tok), layers=1, seed=1), tok, tmp_path, head_tokens=torch.tensor([5, 2, 9]))
    else:
        from conftest import tiny_llama

        feature_draft(tiny_llama(vocab=len(tok), layers=4, seed=0)).save_pretrained(tmp_path)
        tok.save_pretrained(tmp_path)
    draft = load_model(str(tmp_path), "fp32", device=DEVICE)
    if kind == "pruned":
        assert isinstance(draft, PrunedHeadDraft) and _on(draft.head.weight) == _on(draft.token_ids) == DEVICE
    assert _on(draft) == DEVICE


def _tiny_random_dir():
    from draftsmith.sampling.names import resolve

    return resolve("tiny-random")


LOSSES = {
    "ce": {"distill": False, "weights": {"ce": 1.0}},
    "distill_tv": {"distill": True, "temperature": 0.8, "weights": {"tv": 1.0, "forward_kl": 1.0},
                   "anneal": {"term": "forward_kl", "to": 0.1, "over": 0.3}},
    "jsd": {"distill": True, "weights": {"jsd": 1.0, "reverse_kl": 0.5}},
}


@pytest.mark.parametrize("kind,kept,loss", [(kind, kept, loss) for kind, kept in [
    ("independent", False), ("independent", True), ("pruned", True), ("feature", False), ("feature", True)]
    for loss in LOSSES if not (kind == "feature" and loss == "ce")])  # a feature draft distils
def test_a_training_step_runs_on_the_device(kind, kept, loss):
    """The teacher pass (or the kept logits and features, read from the host store and expanded on the device),
    the loss and the backward, for each kind of draft: every tensor the step makes meets the models' device."""
    from conftest import tiny_llama
    from helpers import DeviceReads
    from test_feature import feature_draft

    from draftsmith.data.teacher import TeacherCache
    from draftsmith.drafts.batch import Batch
    from draftsmith.drafts.build import DraftConfig, build_draft
    from draftsmith.train.losses import draft_loss
    from draftsmith.train.module import DraftModule

    target = tiny_llama(vocab=64, layers=4, hidden=32, seed=0)  # built on the host, moved as Lightning moves them
    if kind == "feature":
        draft = feature_draft(target).requires_grad_(True).train()
    else:
        draft = build_draft(target, DraftConfig(layers=1, width_ratio=1.0, init="target"))
    target.to(DEVICE), draft.to(DEVICE)
    head = torch.tensor([0, 3, 5, 9, 11, 63]) if kind == "pruned" else None
    B, T = 2, 10
    cache = None
    if kept:  # filled from records kept on the host, as a corpus sampled by the target leaves them
        feats = 3 * 32 if kind == "feature" else 0
        cache = TeacherCache(B, T - 1, 8, 64, columns=head, features=feats)
        g = torch.Generator().manual_seed(0)
        values = torch.randn(B * (T - 1), 8, generator=g).log_softmax(-1).sort(-1, descending=True).values.half()
        index = torch.randperm(64, generator=g)[:8].repeat(B * (T - 1), 1).int()
        src = torch.arange(B * (T - 1)).view(B, T - 1)
        extra = {"feature_at": src, "features": torch.randn(B * (T - 1), feats, generator=g).half()} if feats else {}
        assert cache.prefill(src, values, index, **extra) == B
    spec = {"temperature": 1.0, "compile": False, "teacher_topk": 8 if kept else 0, **LOSSES[loss]}
    module = DraftModule(draft, target, loss=spec, optim={"lr": 1e-3}, sampler={"temperature": 0.8}, max_steps=10,
                         teacher_cache=cache, head_tokens=head)
    module.to(DEVICE)
    module.objective.to(DEVICE)
    ids = torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with DeviceReads() as reads:
        logits, tlogits, labels, weights = module.objective.train_outputs(module, Batch(ids), torch.arange(B))
        total, _ = draft_loss(logits, labels, tlogits, spec["weights"], spec["temperature"], False, weights)
        total.backward()
    trained = [p for p in draft.parameters() if p.requires_grad]
    assert _on(total) == DEVICE and all(p.grad is not None and _on(p.grad) == DEVICE for p in trained)
    # the target's pass (no KV cache, so transformers checks its positions for packed sequences) reads once
    assert reads.count <= (0 if kept or not LOSSES[loss]["distill"] else 1), reads.names


@pytest.mark.parametrize("on_target", [False, True])
def test_fit_start_measures_on_the_device(on_target):
    """The acceptance callback's set-up (the target's own samples, the draft's cost c in the target's dtype, a
    pruned head's copy) with the target on the device, fed prompts from the host."""
    from helpers import DeviceReads

    from draftsmith.drafts.build import DraftConfig, build_draft
    from draftsmith.train.callbacks import AcceptanceCallback
    from draftsmith.train.module import DraftModule

    class Tok:
        eos_token_id = 0

    from conftest import tiny_llama

    target = tiny_llama(vocab=64, layers=4, hidden=32, seed=0)
    draft = build_draft(target, DraftConfig(layers=1, width_ratio=1.0, init="target"))
    target.to(DEVICE)  # the draft goes where Lightning moves the module, below
    module = DraftModule(draft, target, loss={"distill": True, "weights": {"tv": 1.0}}, optim={"lr": 1e-3},
                         sampler={"temperature": 0.8}, max_steps=10, head_tokens=torch.tensor([1, 2, 3, 4]))
    prompts = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    cb = AcceptanceCallback(prompts, torch.ones_like(prompts), Tok(), k=2, temperature=0.8, top_p=0.95,
                            max_new_tokens=4, on_target_prompts=(prompts, torch.ones_like(prompts)) if on_target
                            else None, on_target_tokens=4)

    class Trainer:
        is_global_zero, world_size = True, 1

    module._device = torch.device(DEVICE)  # where Lightning would have moved it
    module.draft.to(DEVICE)
    with DeviceReads():
        cb.on_fit_start(Trainer(), module)
    assert cb.cost is not None and (not on_target or _on(cb.on_target.ids) == DEVICE)


def test_kept_logits_are_expanded_on_the_device_and_only_the_top_k_crosses(tmp_path):
    """A (B, P, V) teacher built on the host at every step, then copied over, costs a host pass and a copy of the
    vocabulary's width per position; kept top-k records are what crosses, expanded where the draft is. Recorded on
    the CPU: no tensor of the vocabulary's width is made on the host, and the sampling corpus' loop moves only
    (rows, k) to the host."""
    from conftest import tiny_llama
    from torch.overrides import TorchFunctionMode

    from draftsmith.data.generation import own_batches
    from draftsmith.data.teacher import TeacherCache
    from draftsmith.drafts.batch import Batch
    from draftsmith.train.module import DraftModule

    V, B, P = 64, 2, 9

    class HostTensors(TorchFunctionMode):
        """Every tensor a torch call returns on the host with the vocabulary's width, and every .cpu() of one."""
        def __init__(self):
            super().__init__()
            self.wide = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = getattr(func, "__name__", "")
            if name == "cpu" and args[0].shape[-1:] == (V,):
                self.wide.append(f"cpu {tuple(args[0].shape)}")
            if isinstance(out, torch.Tensor) and out.device.type == "cpu" and out.dim() == 3 and out.shape[-1] == V:
                self.wide.append(f"{name} {tuple(out.shape)}")
            return out

    target = tiny_llama(vocab=V, layers=2, hidden=32, seed=0).to(DEVICE)
    draft = tiny_llama(vocab=V, layers=1, hidden=32, seed=1).requires_grad_(True).to(DEVICE)
    cache = TeacherCache(B, P, 8, V)
    src = torch.arange(B * P).view(B, P)
    values = torch.randn(B * P, 8).log_softmax(-1).sort(-1, descending=True).values.half()
    assert cache.prefill(src, values, torch.arange(8).repeat(B * P, 1).int()) == B
    module = DraftModule(draft, target, loss={"distill": True, "weights": {"tv": 1.0}, "compile": False},
                         optim={"lr": 1e-3}, sampler={"temperature": 1.0}, max_steps=1, teacher_cache=cache)
    module.to(DEVICE)
    ids = torch.randint(0, V, (B, P + 1)).to(DEVICE)
    with HostTensors() as seen:
        _, tlogits, _, _ = module.objective.train_outputs(module, Batch(ids), torch.arange(B))
    assert _on(tlogits) == DEVICE and not seen.wide, seen.wide

    host = tiny_llama(vocab=V, layers=2, hidden=32, seed=0)  # the corpus loop, on the host: what it moves over
    with HostTensors() as seen:
        for _ in own_batches(host, [[1, 2, 3], [4, 5]], 2, seed=0, first_row=0, max_new_tokens=3, temperature=1.0,
                             top_p=1.0, eos=None, keep_logits=4):
            pass
    assert not [w for w in seen.wide if w.startswith("cpu")], seen.wide


def test_weights_load_straight_onto_an_accelerator(monkeypatch):
    """A model for a GPU is written onto it as transformers reads it (its device map), never whole in host memory
    first (140 GB of a 70B target in bf16). No GPU here: the loader's request is what is checked, with the model
    left on the host, so nothing is moved after (d614497 moved it: `.to("cuda:1")` fails on a CPU-only torch)."""
    from transformers import AutoModelForCausalLM

    from draftsmith.sampling.load import load_model

    asked, real = [], AutoModelForCausalLM.from_pretrained

    def record(path, **kw):
        asked.append(kw.pop("device_map", None))
        return real(path, **kw)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", record)
    load_model("tiny-random", "fp32", device="cuda:1")
    assert asked == [{"": "cuda:1"}]


def _tiny_draft_dir(path):
    from conftest import tiny_llama
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(_tiny_random_dir())
    tiny_llama(vocab=len(tok), layers=1, hidden=32, seed=1).save_pretrained(path)
    tok.save_pretrained(path)
    return path, tok


def test_generate_runs_the_pair_on_the_device_it_is_given(tmp_path, capsys):
    """`--device`: both models there, the prompt tokenized on the host, the card of the run says where."""
    from helpers import DeviceReads

    from draftsmith.sampling.generate import main

    draft, _ = _tiny_draft_dir(tmp_path / "draft")
    with DeviceReads() as reads:
        rc = main(["--target", "tiny-random", "--draft", str(draft), "--device", DEVICE, "--dtype", "fp32",
                   "--prompt", "def f(x):", "--max-new-tokens", "8", "-k", "2", "--json"])
    assert rc == 0 and (DEVICE != "meta" or reads.count > 0)


def test_a_bundles_figures_are_measured_on_the_device_and_reload_there(tmp_path):
    """export's acceptance and costs run where the pair will serve, and the bundle's draft is loaded back onto the
    target's device for its check (d614497 loaded it on the host beside a GPU target)."""
    from helpers import DeviceReads

    from draftsmith.deploy.export import measure_bundle, reload_check
    from draftsmith.sampling.load import load_model
    from draftsmith.sampling.precision import run_info

    draft_dir, tok = _tiny_draft_dir(tmp_path / "draft")
    target, draft = load_model("tiny-random", "fp32", device=DEVICE), load_model(str(draft_dir), "fp32", device=DEVICE)
    sampler = {"k": 2, "temperature": 0.8, "top_p": 0.95, "top_k": 0}
    with DeviceReads():
        acc, cost = measure_bundle(target, draft, tok, sampler, ["code"], 2, 6, 0, (1, 2))
        spec = {"acceptance": acc, "prompt_sets": ["code"], "n_prompts": 2, "max_new_tokens": 6, "seed": 0,
                **run_info(target=target, draft=draft)}
        reload_check(tmp_path, target, tok, spec, sampler)
    assert set(cost["v"]) == {1, 2} and spec["device"].split(":")[0].split(" ")[0] == DEVICE.split(":")[0]
