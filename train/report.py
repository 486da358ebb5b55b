"""After training: save the best draft as a Hugging Face checkpoint and measure it against the target."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import torch

from draftsmith.sampling.cost import measure_costs, predicted_speedup
from draftsmith.sampling.machine import device_of
from draftsmith.sampling.precision import describe_run, run_info
from draftsmith.sampling.pruned import HEAD_TOKENS, TOKEN_COUNTS, PrunedHeadDraft
from draftsmith.train.build import truncated_target
from draftsmith.train.evaluate import acceptance_by_set
from draftsmith.train.rundir import checkpoint_state, sharded


def draft_from_checkpoint(draft, ckpt_path: str, rebuild: bool = False, device=None):
    """A copy of `draft` with the weights of a training checkpoint (`checkpoint_state`: a Lightning file or a
    DeepSpeed directory), on `device` (default: the draft's); a draft whose parameters ZeRO-3 or FSDP split
    (`rebuild`) is rebuilt from its config there (its shards' device says nothing of where it will run)."""
    state = checkpoint_state(ckpt_path)
    if rebuild:
        with torch.device(device or "cpu"):
            out = type(draft)(draft.config)
    else:
        out = copy.deepcopy(draft).to(device or device_of(draft))
    out.load_state_dict({k.removeprefix("draft."): v for k, v in state.items() if k.startswith("draft.")})
    return out.eval()


def save_draft(draft, tokenizer, path: Path, token_counts: torch.Tensor | None = None,
               head_tokens: torch.Tensor | None = None) -> Path:
    """safetensors + config + tokenizer + generation config: loadable by AutoModelForCausalLM as is. The corpus'
    token counts ride along (`TOKEN_COUNTS`) for an exact pruned draft head (sampling/pruned.py), and the head's
    tokens (`HEAD_TOKENS`) of a draft trained with a pruned head, which `load_model` then runs with it."""
    from safetensors.torch import save_file

    draft.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    for name, key, tensor in ((TOKEN_COUNTS, "counts", token_counts), (HEAD_TOKENS, "token_ids", head_tokens)):
        if tensor is not None:
            (path / name).parent.mkdir(exist_ok=True)
            save_file({key: tensor.detach().cpu().contiguous()}, path / name)
    return path


def measure(target, drafts: dict, tokenizer, cfg, cost: dict | None) -> dict:
    """{draft name: {prompt set: acceptance dict (+ predicted_speedup)}} at the sampler's settings."""
    s = cfg.sampler
    out = {}
    for name, draft in drafts.items():
        out[name] = acceptance_by_set(target, draft, tokenizer, cfg.eval.prompt_sets, n_prompts=cfg.eval.n_prompts,
                                      k=s.k, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                      max_new_tokens=cfg.eval.max_new_tokens, seed=cfg.seed, on_target=True)
        if cost and name != "baseline_cut_target":
            for res in out[name].values():
                res["predicted_speedup"] = predicted_speedup(res["alpha"], s.k, cost["c"], cost["v"][s.k])
    return out


def final_report(*, target, module, tokenizer, cfg, out_dir: Path, checkpoint_cb, last_path: str, acceptance_cb,
                 wall_s: float, tokens_per_s: float | None, precision: str,
                 token_counts: torch.Tensor | None = None) -> dict:
    # what training held at its peak on this rank's GPU, read before the report's own measurements add to it
    peak = torch.cuda.max_memory_allocated() / 2**30 if device_of(target).type == "cuda" else None
    t0 = time.time()
    last = module.draft.eval()
    if sharded(module):  # ZeRO-3 or FSDP: this rank holds a shard; the last checkpoint holds it whole
        last = draft_from_checkpoint(last, last_path, rebuild=True, device=device_of(target))
    best_path = checkpoint_cb.best_model_path
    best = draft_from_checkpoint(last, best_path) if best_path else last
    head = module.head_tokens
    best_dir = save_draft(best, tokenizer, out_dir / "best_draft", token_counts, head)
    n_params = sum(p.numel() for p in best.parameters())
    if head is not None:  # measured as the sampler will run them: with the head they were trained with
        best, last = PrunedHeadDraft(best, head).eval(), PrunedHeadDraft(last, head).eval()
    drafts = {"best": best, "last": last}
    if cfg.eval.baseline:
        drafts["baseline_cut_target"] = truncated_target(target, best.config.num_hidden_layers)
    # c measured again now, on the best draft in the target's dtype, with no trainer or logger starting up beside
    # it (the measurement at fit start shares the CPU with them).
    cost_draft = copy.deepcopy(best).to(target.dtype)
    cost = measure_costs(target, cost_draft, ks=(cfg.sampler.k,))
    with torch.inference_mode():
        results = measure(target, drafts, tokenizer, cfg, cost)
    report = {
        "best_draft": str(best_dir),
        "best_checkpoint": best_path,
        "monitor": cfg.checkpoint.monitor,
        "best_score": float(checkpoint_cb.best_model_score) if checkpoint_cb.best_model_score is not None else None,
        "sampler": {"k": cfg.sampler.k, "temperature": cfg.sampler.temperature, "top_p": cfg.sampler.top_p},
        "c": cost["c"],
        "cost": cost,
        "cost_at_fit_start": acceptance_cb.cost,
        "validation_history": acceptance_cb.history,
        "eval": results,
        "train_tokens_per_s": tokens_per_s,
        "peak_gpu_memory_gib": peak,  # rank 0's, allocated tensors (the plan's accounting), not the allocator's cache
        "wall_s": wall_s + time.time() - t0,  # everything, this report's measurements included
        "training_precision": precision,  # the draft's; the target's and the cost models' are in run_info
        **run_info(target=target, draft=cost_draft),
        "draft_layers": best.config.num_hidden_layers,
        "draft_params": n_params,
        "draft_head_tokens": None if head is None else len(head),
    }
    (out_dir / "report.json").write_text(json.dumps(report, indent=2, default=str))
    plot_report(report, out_dir / "acceptance.png")
    return report


def plot_report(report: dict, path: Path) -> None:
    """The run at a glance: acceptance at each validation (left), the final drafts' acceptance on each prompt set,
    sampled and teacher-forced on the target's samples, against the cut-target baseline (middle), and the best
    draft's acceptance at each draft position (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right, third) = plt.subplots(1, 3, figsize=(17, 4.2))
    hist = report["validation_history"]
    for key, style in (("val/alpha_on_target", "o-"), ("val/alpha", "s--"), ("val/alpha_analytic", "^:")):
        pts = [(h["step"], h[key]) for h in hist if key in h]
        if pts:
            left.plot(*zip(*pts), style, label=key)
    left.set_xlabel("step")
    left.set_ylabel("acceptance")
    left.set_title(f"validation ({report['monitor']} best {report['best_score'] or float('nan'):.3f})")
    left.legend()
    names, sets = list(report["eval"]), sorted({ps for r in report["eval"].values() for ps in r})
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(sets))]
        right.bar(xs, [report["eval"][name][ps]["alpha_on_target"] for ps in sets], width, label=name)
        right.scatter(xs, [report["eval"][name][ps]["alpha"] for ps in sets], color="black", s=12, zorder=3)
    right.set_xticks(range(len(sets)), sets)
    s = report["sampler"]
    right.set_ylabel("alpha_on_target (bars), alpha (dots)")
    right.set_title(f"final drafts, T {s['temperature']}, top-p {s['top_p']}, K {s['k']}; c {report['c']:.3f}")
    right.legend()
    acceptance_by_position(third, report["eval"].get("best", {}))
    third.set_title("best draft: " + third.get_title())
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def acceptance_by_position(ax, acceptance: dict) -> None:
    """Acceptance at each draft position, given the position was reached, per prompt set, against alpha (dotted):
    the paper's i.i.d. assumption makes it flat, and tokens per call then follow from alpha alone."""
    for name, r in acceptance.items():
        pts = [(i + 1, a) for i, a in enumerate(r.get("acceptance_by_position") or []) if a is not None]
        if pts:
            line, = ax.plot(*zip(*pts), "o-", label=f"{name} (alpha {r['alpha']:.3f})")
            ax.axhline(r["alpha"], ls=":", color=line.get_color())
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("draft position i")
    ax.set_ylabel("P(token i accepted | reached)")
    ax.set_title("acceptance by position (dotted: alpha)")
    ax.set_ylim(0, 1)
    if ax.lines:
        ax.legend()


def print_report(report: dict) -> None:
    s = report["sampler"]
    print(f"\nbest draft: {report['best_draft']}")
    print(f"  (checkpoint {report['best_checkpoint']}, {report['monitor']} = {report['best_score']})")
    print(f"acceptance at T={s['temperature']}, top-p={s['top_p']}, K={s['k']} on held-out prompt sets:")
    print(f"  {'draft':<22}{'prompts':<10}{'alpha':>8}{'alpha_analytic':>16}{'alpha_on_target':>17}{'tok/call':>10}"
          f"{'pred. speed-up':>16}")
    for name, sets in report["eval"].items():
        for ps, r in sets.items():
            sp = f"{r['predicted_speedup']:.2f}x" if "predicted_speedup" in r else "-"
            print(f"  {name:<22}{ps:<10}{r['alpha']:>8.3f}{r['alpha_analytic']:>16.3f}{r['alpha_on_target']:>17.3f}"
                  f"{r['tokens_per_call']:>10.2f}{sp:>16}")
    if report["c"] is not None:
        print(f"draft cost c = {report['c']:.3f} of a target step (measured here)")
    if report["train_tokens_per_s"]:
        print(f"training throughput: {report['train_tokens_per_s']:.0f} tokens/s")
    if report.get("peak_gpu_memory_gib") is not None:
        print(f"peak GPU memory in training: {report['peak_gpu_memory_gib']:.2f} GiB (rank 0, allocated)")
    print(f"wall time: {report['wall_s'] / 60:.1f} min (training precision {report['training_precision']}; "
          f"{describe_run(report)})")
    print(f"plot: {Path(report['best_draft']).parent / 'acceptance.png'}")
