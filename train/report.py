"""After training: save the best draft as a Hugging Face checkpoint and measure it against the target."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import torch

from draftsmith.drafts.build import truncated_target
from draftsmith.drafts.evaluate import CHAT_SET, acceptance_by_set
from draftsmith.drafts.plots import plot_report
from draftsmith.drafts.saved import checkpoint_state, draft_from_checkpoint, save_draft
from draftsmith.sampling.compiled import compile_report
from draftsmith.sampling.cost import measure_costs, predicted_speedup
from draftsmith.sampling.machine import device_of
from draftsmith.sampling.precision import describe_run, run_info
from draftsmith.sampling.pruned import PrunedHeadDraft
from draftsmith.sampling.stats import TAU
from draftsmith.train.module import WeightAverage
from draftsmith.train.rundir import sharded


def chat_of(cfg) -> dict | None:
    """{"enable_thinking"} for a run that trained through the target's chat template (data=chat, or
    data.chat_template=true: prompts as one user turn), else None: its acceptance is measured through it too."""
    if cfg.data.get("format") == "chat" or cfg.data.get("chat_template"):
        return {"enable_thinking": cfg.data.get("enable_thinking")}
    return None


def eval_sets(cfg) -> list[str]:
    """eval.prompt_sets, with the held-out chat set first when training went through the template: a draft trained
    on what a chat target writes is judged on it too."""
    sets = list(cfg.eval.prompt_sets)
    return [CHAT_SET] + sets if chat_of(cfg) is not None and CHAT_SET not in sets else sets


def measure(target, drafts: dict, tokenizer, cfg, cost: dict | None) -> dict:
    """{draft name: {prompt set: acceptance dict (+ predicted_speedup)}} at the sampler's settings."""
    s = cfg.sampler
    out = {}
    for name, draft in drafts.items():
        out[name] = acceptance_by_set(target, draft, tokenizer, eval_sets(cfg), n_prompts=cfg.eval.n_prompts,
                                      k=s.k, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                      max_new_tokens=cfg.eval.max_new_tokens, seed=cfg.seed, on_target=True,
                                      chat=chat_of(cfg))
        if cost and name != "baseline_cut_target":
            for res in out[name].values():
                res["predicted_speedup"] = predicted_speedup(res["alpha"], s.k, cost["c"], cost["v"][s.k])
    return out


@torch.inference_mode()
def head_mass(target, head: torch.Tensor, tokenizer, cfg) -> dict[str, float]:
    """{prompt set: the target's mean probability mass on a pruned head's tokens}, after the sampler's temperature,
    top-k and top-p, over its own samples of the set's prompts (the samples `measure`'s alpha_on_target is taken
    on: the same prompts and seed). A draft never proposes a token outside its head, so per position acceptance is
    at most this mass: a ceiling on alpha that no training lifts (only more or other head tokens do)."""
    from draftsmith.drafts.evaluate import chat_prompts, target_samples
    from draftsmith.sampling.probs import SamplingConfig, process_logits
    from draftsmith.sampling.prompts import encode_prompts, load_prompts, pad_id, user_turn

    s, chat = cfg.sampler, chat_of(cfg)
    thinking = (chat or {}).get("enable_thinking")
    out = {}
    for ps in eval_sets(cfg):
        if ps == CHAT_SET:
            texts, special = chat_prompts(tokenizer, cfg.eval.n_prompts or 8, thinking), False
        else:
            texts, special = [r["prompt"] for r in load_prompts(ps, cfg.eval.n_prompts)], chat is None
            if chat is not None:
                texts = [user_turn(tokenizer, t, thinking) for t in texts]
        ids, mask = (t.to(device_of(target)) for t in encode_prompts(tokenizer, texts, special_tokens=special))
        b = target_samples(target, ids, mask, max_new_tokens=cfg.eval.max_new_tokens, temperature=s.temperature,
                           top_p=s.top_p, top_k=s.top_k, eos_token_id=tokenizer.eos_token_id,
                           pad_token_id=pad_id(tokenizer), seed=cfg.seed + 1)
        q = process_logits(b.logits(target), SamplingConfig(s.temperature, s.top_k, s.top_p))
        mass = q.index_select(-1, head.to(q.device)).sum(-1)
        out[ps] = float(mass[b.loss_mask].mean())
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
    if best_path and getattr(module, "ema", None) is not None:  # optim.ema: the average is what validation chose
        WeightAverage.load_into(best, checkpoint_state(best_path))
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
        "chat_template": chat_of(cfg),  # trained through the template: its acceptance measured through it
        "c": cost["c"],
        "cost": cost,
        "cost_at_fit_start": acceptance_cb.cost,
        "validation_history": acceptance_cb.history,
        # the decoding step shapes torch.compile built in this process (sampler.compile=true: validation's and the
        # fit-start cost's), with their seconds; empty where every step ran eagerly
        "compiled": compile_report(),
        "eval": results,
        "train_tokens_per_s": tokens_per_s,
        "peak_gpu_memory_gib": peak,  # rank 0's, allocated tensors (the plan's accounting), not the allocator's cache
        "wall_s": wall_s + time.time() - t0,  # everything, this report's measurements included
        "training_precision": precision,  # the draft's; the target's and the cost models' are in run_info
        **run_info(target=target, draft=cost_draft),
        "draft_layers": best.config.num_hidden_layers,
        "draft_params": n_params,
        "draft_head_tokens": None if head is None else len(head),
        # the target's mass on the head's tokens per prompt set: a ceiling on alpha (`head_mass`)
        "head_mass": None if head is None else head_mass(target, head, tokenizer, cfg),
    }
    (out_dir / "report.json").write_text(json.dumps(report, indent=2, default=str))
    plot_report(report, out_dir / "acceptance.png")
    return report


def print_report(report: dict) -> None:
    s = report["sampler"]
    print(f"\nbest draft: {report['best_draft']}")
    print(f"  (checkpoint {report['best_checkpoint']}, {report['monitor']} = {report['best_score']})")
    print(f"acceptance at T={s['temperature']}, top-p={s['top_p']}, K={s['k']} on held-out prompt sets (tau: {TAU}, "
          "tokens per target call)" + (", each prompt one user turn through the target's chat template (data=chat)"
                                       if report.get("chat_template") else "") + ":")
    print(f"  {'draft':<22}{'prompts':<10}{'alpha':>8}{'alpha_analytic':>16}{'alpha_on_target':>17}{'tau':>10}"
          f"{'pred. speed-up':>16}")
    for name, sets in report["eval"].items():
        for ps, r in sets.items():
            sp = f"{r['predicted_speedup']:.2f}x" if "predicted_speedup" in r else "-"
            print(f"  {name:<22}{ps:<10}{r['alpha']:>8.3f}{r['alpha_analytic']:>16.3f}{r['alpha_on_target']:>17.3f}"
                  f"{r['tokens_per_call']:>10.2f}{sp:>16}")
    if report.get("head_mass"):
        print(f"the target's mass on the draft head's {report['draft_head_tokens']} tokens (a ceiling on alpha): "
              + ", ".join(f"{ps} {m:.3f}" for ps, m in report["head_mass"].items()))
    if report["c"] is not None:
        print(f"draft cost c = {report['c']:.3f} of a target step (measured here)")
    if report["train_tokens_per_s"]:
        print(f"training throughput: {report['train_tokens_per_s']:.0f} tokens/s")
    if report.get("peak_gpu_memory_gib") is not None:
        print(f"peak GPU memory in training: {report['peak_gpu_memory_gib']:.2f} GiB (rank 0, allocated)")
    print(f"wall time: {report['wall_s'] / 60:.1f} min (training precision {report['training_precision']}; "
          f"{describe_run(report)})")
    print(f"plot: {Path(report['best_draft']).parent / 'acceptance.png'}")
