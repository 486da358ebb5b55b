"""`plan=true`: the draft's shape and each rank's memory under each strategy, from a target's config alone. The
figures are checked where they can be: against a tiny draft actually built and stepped with AdamW."""

import gc

import pytest
import torch
from conftest import run_entry
from transformers import AutoModelForCausalLM, LlamaConfig

from draftsmith.train.build import DraftConfig, draft_config_for
from draftsmith.train.plan import plan


def tiny_target_config(vocab=300):
    return LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=320, num_hidden_layers=20,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)


def test_plan_counts_what_a_built_and_stepped_draft_holds():
    tc = tiny_target_config()
    dc = draft_config_for(tc, DraftConfig())
    p = plan(tc, dc, ranks=4, batch=2, block=32)
    draft = AutoModelForCausalLM.from_config(dc)
    n = sum(t.numel() for t in draft.parameters())
    assert p.draft_params == n and p.draft_layers == 2 and p.draft_hidden == 96  # a tenth, three quarters
    assert p.target_params == sum(t.numel() for t in AutoModelForCausalLM.from_config(tc).parameters())
    opt = torch.optim.AdamW(draft.parameters())
    draft(torch.zeros(1, 4, dtype=torch.long), labels=torch.zeros(1, 4, dtype=torch.long)).loss.backward()
    opt.step()
    moments = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.dim() > 0)
    grads = sum(t.grad.numel() * t.grad.element_size() for t in draft.parameters())
    ddp = p.per_rank("ddp")
    assert ddp["optimizer"] == moments and ddp["gradients"] == grads and ddp["weights"] == 4 * n
    z2, z3 = p.per_rank("deepspeed_stage_2"), p.per_rank("deepspeed_stage_3")
    assert z2["weights"] == 4 * n and z2["optimizer"] == moments / 4 and z3["weights"] == n
    assert p.per_rank("fsdp") == z3 and ddp["target (bf16 replica)"] == 2 * p.target_params
    with pytest.raises(ValueError, match="unknown strategy"):
        p.per_rank("zero9")


def _live_bytes(prof, marker: str | None) -> tuple[int, int]:
    """(peak of the live bytes allocated in the profiled block, peak of those allocated since the last `marker`
    event). Each allocation is followed by its address in the profiler's allocation records, so a tensor freed in
    the block that was allocated before it (garbage of an earlier test, a tensor held when the marker passed) does
    not offset what the block allocates."""
    allocations, marks, todo = [], [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        node = todo.pop()
        todo.extend(node.children)
        if type(node.extra_fields).__name__ == "_ExtraFields_Allocation":
            allocations.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size))
        elif node.name == marker:
            marks.append(node.start_time_ns)
    at = max(marks) if marks else float("inf")
    peaks, live, held = [0, 0], [0, 0], [{}, {}]  # [everything in the block, what is allocated after the marker]
    for t, ptr, n in sorted(allocations):
        for k in (0, 1):
            if n > 0 and (k == 0 or t >= at):
                held[k][ptr] = n
                live[k] += n
            elif n < 0 and held[k].pop(ptr, None) is not None:
                live[k] += n
            peaks[k] = max(peaks[k], live[k])
    return peaks[0], peaks[1]


def test_a_teacher_forced_pass_builds_no_kv_cache():
    """The target's teacher pass keeps no KV cache: no grad, so nothing else holds its keys and values, and they
    would sit beside the draft's logits until the pass returns (2 x layers x tokens x KV width x 2 bytes: 2.7 GB a
    micro-batch at 70B, in no row of the plan)."""
    from torch.profiler import ProfilerActivity, profile

    from draftsmith.train.onpolicy import Batch

    tc = tiny_target_config(2000)
    target = AutoModelForCausalLM.from_config(tc).to(torch.bfloat16).eval()
    ids = torch.randint(0, 2000, (4, 128))
    gc.collect()
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        logits = Batch(ids).logits(target)
    peak, _ = _live_bytes(prof, None)
    tokens, kv = 4 * 127, tc.num_key_value_heads * tc.hidden_size // tc.num_attention_heads
    cache = 2 * tc.num_hidden_layers * tokens * kv * 2
    assert logits.numel() * 2 <= peak < logits.numel() * 2 + cache / 2, (peak, cache)


def test_plan_for_the_70b_shape_prints_the_papers_ratio(tmp_path):
    res = run_entry("recipe=paper_ratio_70b", "plan=true", "trainer.devices=8", f"hydra.run.dir={tmp_path}")
    assert res.returncode == 0, res.stderr[-2000:]
    out = res.stdout
    print(out)
    assert "target 80 layers, d 8192" in out and "draft: 8 layers, d 6144" in out
    assert "per rank, 8 rank(s), micro-batch 4 x 2048 tokens" in out
    assert all(s in out for s in ("ddp", "deepspeed_stage_2", "deepspeed_stage_3", "fsdp"))
    assert not (tmp_path / "checkpoints").exists()  # nothing was trained
