"""The paper's Table 1 and Figure 1 for any draft+target pair on this machine, with the speed-up model beside them.

    draftsmith bench paper outputs/DATE/TIME                              # a run: its best draft and its target
    draftsmith bench paper DIR --target smollm2-135m --draft-vocab 4096 --prompts my_prompts.jsonl --n-prompts 4
    draftsmith bench paper SHALLOW_WIDE_RUN FEATURE_HEAD_RUN             # both kinds side by side, one run
    draftsmith bench paper BUNDLE --compile --k-sweep 0 1 2 3 4          # our loops with compiled steps

Table 1: ArS vs SpS (batch 1, K=4, 128 new tokens, code at T 0.8 / top-p 0.95, text at T 1 / top-p 0.8):
ms/token, speed-up, alpha, tokens per call, and a two-sample test that SpS and ArS outputs share a distribution.
Figure 1: K = 0..8: time for 128 tokens (mean, std), acceptance efficiency, time per loop -> PNG + JSON.
The speed-up model: c and v(K) measured here, predicted vs measured speed-up per K, the recommended K.
Peers in the same run: transformers `generate` and assisted generation with the same pair.
Everything runs interleaved (configs shuffled per prompt) so load on the machine hits all configs alike.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import torch
from scipy.stats import ks_2samp, mannwhitneyu

from draftsmith.sampling import autoregressive_generate, speculative_generate
from draftsmith.sampling.cli import add_artifact, artifact_of, draft_label, examples, locate_draft, target_of
from draftsmith.sampling.compiled import check_compilable
from draftsmith.sampling.cost import best_k, measure_costs, predicted_speedup
from draftsmith.sampling.feature import is_feature_draft
from draftsmith.sampling.load import load_tokenizer
from draftsmith.sampling.machine import default_device
from draftsmith.sampling.precision import describe_run, run_info
from draftsmith.sampling.probs import sequence_logprob
from draftsmith.sampling.prompts import load_prompts
from draftsmith.sampling.pruned import PrunedHeadDraft, prune_from_dir, top_tokens
from draftsmith.sampling.runtime import DTYPE_CHOICES, prepared_model
from draftsmith.sampling.stats import TAU, summary

DOMAIN_SETTINGS = {"code": (0.8, 0.95), "english": (1.0, 0.8), "text": (1.0, 0.8)}  # the paper's nucleus settings


def pruned_draft(draft, draft_dir: Path, tok, n: int):
    try:
        return prune_from_dir(draft, draft_dir, n, [tok.eos_token_id])
    except FileNotFoundError:  # a run that predates saved counts: recount the default corpus (cached)
        from draftsmith.data.corpus import load_blocks

        print("token counts not in the draft dir: counting the stdlib corpus", file=sys.stderr)
        counts = torch.bincount(load_blocks("stdlib", tok, 256)["train"].flatten(), minlength=len(tok))
        return PrunedHeadDraft(draft, top_tokens(counts, n, [tok.eos_token_id]))


def main(argv=None, prog=None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0], epilog=examples(__doc__),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_artifact(ap, "bundle(s), run dir(s) or draft checkpoint dir(s): independent or feature drafts; several are "
                     "measured side by side against the same ArS runs", many=True)
    ap.add_argument("--target", help="default: the first artifact's target (a bundle's or run's); required otherwise")
    ap.add_argument("--prompts", nargs="+", default=["code", "english"],
                    help="shipped prompt sets (code, english) or JSONL files with a `prompt` field (optional `domain`)")
    ap.add_argument("--n-prompts", type=int, default=4, help="per prompt file")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("-k", type=int, default=4, help="K of Table 1")
    ap.add_argument("--k-sweep", type=int, nargs="+", default=list(range(0, 9)), help="Ks of Figure 1 (0 = ArS)")
    ap.add_argument("--k-auto", action=argparse.BooleanOptionalAction, default=True,
                    help="also run k=auto (drafting stops where the draft's confidence, the running acceptance "
                         "and the measured c, v(K) say one more token does not pay)")
    ap.add_argument("--draft-vocab", type=int, default=0, help="prune the draft head to the N most frequent tokens")
    ap.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                    help="precision of both models (auto: the faster one for decoding on this machine, measured)")
    ap.add_argument("--peers", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--out", default="bench", help="output directory for bench.json and figure1.png")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=default_device(), help="where both models run (default: %(default)s)")
    ap.add_argument("--compile", action="store_true",
                    help="our loops and the cost model with compiled static-shape steps (independent drafts only); "
                         "every shape is compiled by an untimed pass over the first prompt")
    args = ap.parse_args(argv)
    try:
        sources = [locate_draft(d) for d in artifact_of(args, required=True)]
        args.draft = [d.path for d in sources]
        args.target = target_of(args.target, sources[0])
        tok = load_tokenizer(args.target)
        target = prepared_model(args.target, args.dtype, device=args.device)
        full_drafts = {}
        for d in args.draft:
            full_drafts[draft_label(d, full_drafts)] = prepared_model(d, args.dtype, device=args.device)
        if args.compile:
            for d in full_drafts.values():
                check_compilable(d)
        rows = [r for f in args.prompts for r in load_prompts(f, args.n_prompts)]
    except ValueError as e:  # a DraftsmithError, or bad input
        print(f"error: {e}", file=sys.stderr)
        return 2
    drafts = dict(full_drafts)
    if args.draft_vocab:  # the pruned head of an independent draft (a feature draft's head is set in training)
        drafts = {n: d if is_feature_draft(d) or isinstance(d, PrunedHeadDraft)  # head chosen in training
                  else pruned_draft(d, Path(p), tok, args.draft_vocab)
                  for (n, d), p in zip(full_drafts.items(), args.draft)}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    N = args.max_new_tokens
    rng = random.Random(args.seed)

    ks_cost = sorted({k for k in args.k_sweep if k > 0} | {args.k})
    costs, full_cs = {}, {}
    for name, draft in drafts.items():
        print(f"measuring c and v(K) of {name}...", file=sys.stderr)
        with torch.inference_mode():
            costs[name] = measure_costs(target, draft, ks=ks_cost, compile=args.compile)
            if args.draft_vocab and draft is not full_drafts[name]:
                full_cs[name] = measure_costs(target, full_drafts[name], ks=(1,), reps=7)["c"]
    # transformers' assisted generation takes an independent draft only (no EAGLE path)
    assistant = next((d for d in full_drafts.values() if not is_feature_draft(d)), None)
    if assistant is not None:
        assistant.generation_config.update(num_assistant_tokens=args.k, num_assistant_tokens_schedule="constant",
                                           assistant_confidence_threshold=0.0)

    ks = sorted(set(args.k_sweep) | {args.k})
    runs = []  # one record per (prompt, config)
    warm_up = [(-1, rows[0])] if args.compile else []  # compiles every shape our loops meet, untimed
    for i, row in warm_up + list(enumerate(rows)):
        domain = row["domain"]
        T, P = DOMAIN_SETTINGS.get(domain, (0.8, 0.95))
        ids = tok(row["prompt"], return_tensors="pt").input_ids
        configs = [("ours", None, 0)] + [("ours", n, k) for n in drafts for k in ks if k > 0]
        if args.k_auto:
            configs += [("ours", n, "auto") for n in drafts]
        if args.peers:
            configs += [("hf_generate", None, 0)] + ([("hf_assisted", None, args.k)] if assistant is not None else [])
        rng.shuffle(configs)
        for name, dname, k in configs:
            if i < 0 and name != "ours":
                continue
            g = torch.Generator().manual_seed(args.seed * 1000 + i)
            common = dict(max_new_tokens=N, temperature=T, top_p=P, generator=g, compile=args.compile)
            if name == "ours" and k == 0:
                gen = autoregressive_generate(target, ids, **common)
            elif name == "ours" and k == "auto":
                gen = speculative_generate(target, drafts[dname], ids, k="auto", k_max=max(ks), cost=costs[dname],
                                           **common)
            elif name == "ours":
                gen = speculative_generate(target, drafts[dname], ids, k=k, **common)
            if i < 0:
                continue
            if name != "ours":
                import time

                hf = dict(max_new_tokens=N, min_new_tokens=N, do_sample=True, temperature=T, top_p=P, top_k=0,
                          pad_token_id=tok.eos_token_id)
                if name == "hf_assisted":
                    hf["assistant_model"] = assistant
                t = time.perf_counter()
                with torch.inference_mode():
                    target.generate(ids, **hf)
                runs.append({"prompt": i, "domain": domain, "config": name, "k": k, "time_s": time.perf_counter() - t})
                continue
            s = gen.stats
            rec = {"prompt": i, "domain": domain, "config": "ars" if k == 0 else "sps", "k": k, "draft": dname,
                   "time_s": s.total_s, "new_tokens": s.new_tokens, "target_calls": s.target_calls,
                   "alpha": s.alpha, "alpha_analytic": s.alpha_analytic, "tokens_per_call": s.tokens_per_call,
                   "token_ms": s.token_latencies_ms(), "draft_s": s.draft_s, "target_s": s.target_s,
                   "overhead_s": s.overhead_s}
            if k == "auto":
                rec["k_per_loop"] = s.k_per_loop
            if k in (0, args.k):
                rec["target_logprob"] = sequence_logprob(target, ids[0].tolist(), gen.tokens[0].tolist())
            runs.append(rec)
        print("warm-up (every shape compiled) done" if i < 0 else f"prompt {i + 1}/{len(rows)} ({domain}) done",
              file=sys.stderr, flush=True)

    by_draft = {}
    for n in drafts:  # each draft's SpS runs against the shared ArS and peer runs
        mine = [r for r in runs if r.get("draft") in (None, n)]
        by_draft[n] = summarise(mine, costs[n], args, full_cs.get(n))
    info = run_info(target=target, **{f"draft:{n}": d for n, d in full_drafts.items()})
    first = next(iter(by_draft))
    out = {"args": vars(args), **info, "cost": costs[first], **by_draft[first], "costs": costs, "by_draft": by_draft,
           "draft_kinds": {n: "feature_head" if is_feature_draft(d) else "independent" for n, d in drafts.items()},
           "runs": runs}
    (out_dir / "bench.json").write_text(json.dumps(out, indent=2, default=float))
    plot(by_draft, out_dir / "figure1.png", args)
    for n, result in by_draft.items():
        print(f"\n=== draft {n} ({out['draft_kinds'][n]}) ===")
        print_tables(result, costs[n], args, full_cs.get(n))
    print(f"measured on: {describe_run(info)}")
    print(f"\nwrote {out_dir / 'bench.json'} and {out_dir / 'figure1.png'}")
    return 0


def summarise(runs, cost, args, full_c):
    N = args.max_new_tokens
    by = lambda **kw: [r for r in runs if all(r.get(a) == b for a, b in kw.items())]  # noqa: E731
    domains = sorted({r["domain"] for r in runs})
    table1 = {}
    for d in domains:
        ars, sps = by(domain=d, config="ars"), by(domain=d, config="sps", k=args.k)
        speedups = [a["time_s"] / s["time_s"] for a in ars for s in sps if a["prompt"] == s["prompt"]]
        lp_a, lp_s = [r["target_logprob"] for r in ars], [r["target_logprob"] for r in sps]
        alpha = statistics.mean(r["alpha"] for r in sps)
        row = {
            "ars_ms_per_token": summary([1e3 * r["time_s"] / N for r in ars]),
            "sps_ms_per_token": summary([1e3 * r["time_s"] / N for r in sps]),
            "speedup_median": statistics.median(speedups), "speedup_mean": statistics.mean(speedups),
            "alpha": alpha, "alpha_analytic": statistics.mean(r["alpha_analytic"] for r in sps),
            "tokens_per_call": statistics.mean(r["tokens_per_call"] for r in sps),
            "predicted_speedup": predicted_speedup(alpha, args.k, cost["c"], cost["v"][args.k]),
            "same_distribution_ks_pvalue": float(ks_2samp(lp_a, lp_s).pvalue) if len(lp_a) > 1 else None,
            "same_distribution_mwu_pvalue": float(mannwhitneyu(lp_a, lp_s).pvalue) if len(lp_a) > 1 else None,
            "target_logprob_ars": statistics.mean(lp_a), "target_logprob_sps": statistics.mean(lp_s),
            "sps_token_ms": summary([x for r in sps for x in r["token_ms"]]),
            "ars_token_ms": summary([x for r in ars for x in r["token_ms"]]),
        }
        hf_g, hf_a = by(domain=d, config="hf_generate"), by(domain=d, config="hf_assisted")
        if hf_g:
            row["ours_ars_vs_hf_generate"] = statistics.median(
                g["time_s"] / a["time_s"] for a in ars for g in hf_g if a["prompt"] == g["prompt"])
            row["ours_sps_vs_hf_assisted"] = statistics.median(
                h["time_s"] / s["time_s"] for s in sps for h in hf_a if s["prompt"] == h["prompt"])
            row["hf_assisted_speedup"] = statistics.median(
                g["time_s"] / h["time_s"] for h in hf_a for g in hf_g if h["prompt"] == g["prompt"])
        table1[d] = row
    figure1 = {}
    alpha_all = statistics.mean(r["alpha"] for r in by(config="sps", k=args.k))
    for k in sorted({r["k"] for r in runs if r["config"] in ("ars", "sps") and r["k"] != "auto"}):
        rs = [r for r in runs if r["config"] in ("ars", "sps") and r["k"] == k]
        ars_t = {(r["prompt"]): r["time_s"] for r in by(config="ars")}
        loops = [r["target_calls"] for r in rs]
        tpc = statistics.mean(r["tokens_per_call"] for r in rs)
        alpha_k = statistics.mean(r["alpha"] for r in rs) if k else None
        figure1[k] = {
            "time_s": summary([r["time_s"] * N / r["new_tokens"] for r in rs]),
            "acceptance_efficiency": tpc / (k + 1), "tokens_per_call": tpc, "alpha": alpha_k,
            "ms_per_loop": statistics.mean(1e3 * r["time_s"] / max(1, c) for r, c in zip(rs, loops)),
            "measured_speedup": statistics.median(ars_t[r["prompt"]] / r["time_s"] for r in rs),
            "predicted_speedup": 1.0 if k == 0 else predicted_speedup(alpha_k, k, cost["c"], cost["v"][k]),
        }
    rec_k, rec_s = best_k(alpha_all, cost["c"], {k: v for k, v in cost["v"].items()})
    auto = by(config="sps", k="auto")
    k_auto = None
    if auto:
        ars_t = {r["prompt"]: r["time_s"] for r in by(config="ars")}
        best_fixed = max((k for k in figure1 if k), key=lambda k: figure1[k]["measured_speedup"], default=None)
        k_auto = {"measured_speedup": statistics.median(ars_t[r["prompt"]] / r["time_s"] for r in auto),
                  "alpha": statistics.mean(r["alpha"] for r in auto),
                  "mean_k": statistics.mean(k for r in auto for k in r["k_per_loop"]),
                  "best_fixed_k": best_fixed,
                  "best_fixed_speedup": figure1[best_fixed]["measured_speedup"] if best_fixed else None}
    return {"table1": table1, "figure1": figure1, "recommended_k": rec_k, "recommended_k_predicted": rec_s,
            "c_full_head": full_c, "k_auto": k_auto}


def plot(by_draft: dict, path, args):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 4, figsize=(18, 4))
    for name, result in by_draft.items():
        f1 = result["figure1"]
        ks = sorted(f1)
        mean = [f1[k]["time_s"]["mean"] * 1e3 for k in ks]
        std = [f1[k]["time_s"]["std"] * 1e3 for k in ks]
        line = ax[0].errorbar(ks, mean, yerr=std, marker="o", capsize=3, label=name)[0]
        color = line.get_color()
        ax[1].plot(ks, [f1[k]["acceptance_efficiency"] for k in ks], marker="o", color=color, label=name)
        ax[2].plot(ks, [f1[k]["ms_per_loop"] for k in ks], marker="o", color=color, label=name)
        ax[3].plot(ks, [f1[k]["predicted_speedup"] for k in ks], "--", marker="x", color=color,
                   label=f"{name}: predicted (measured c, v(K))")
        ax[3].plot(ks, [f1[k]["measured_speedup"] for k in ks], "-", marker="s", color=color,
                   label=f"{name}: measured")
    ax[0].set(xlabel="K", ylabel=f"ms for {args.max_new_tokens} tokens", title="Mean time to sample (± std)")
    ax[1].set(xlabel="K", ylabel="mean tokens per loop / (K+1)", title="Acceptance efficiency", ylim=(0, 1.05))
    ax[2].set(xlabel="K", ylabel="ms per loop", title="Time per loop")
    ax[3].axhline(1.0, color="gray", lw=0.8)
    ax[3].set(xlabel="K", ylabel="speed-up vs ArS", title="Speed-up: model vs measurement")
    for a in ax:
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    fig.suptitle(f"{args.target} + " + ", ".join(by_draft) + (f" (independent drafts' head: top {args.draft_vocab})"
                                                              if args.draft_vocab else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_tables(result, cost, args, full_c):
    print(f"\nTable 1 (batch 1, K={args.k}, {args.max_new_tokens} new tokens; tau: {TAU}, tokens per target call)")
    print(f"{'domain':<9}{'ArS ms/tok':>12}{'SpS ms/tok':>12}{'speed-up':>10}{'predicted':>10}{'alpha':>7}"
          f"{'tau':>9}{'same-dist p':>12}{'vs HF gen':>10}{'vs HF asst':>11}")
    for d, r in result["table1"].items():
        a, s = r["ars_ms_per_token"], r["sps_ms_per_token"]
        print(f"{d:<9}{a['mean']:>7.1f}±{a['std']:<4.1f}{s['mean']:>7.1f}±{s['std']:<4.1f}"
              f"{r['speedup_median']:>9.2f}x"
              f"{r['predicted_speedup']:>9.2f}x{r['alpha']:>7.3f}{r['tokens_per_call']:>9.2f}"
              f"{r['same_distribution_ks_pvalue'] or float('nan'):>12.3f}"
              f"{r.get('ours_ars_vs_hf_generate', float('nan')):>9.2f}x"
              f"{r.get('ours_sps_vs_hf_assisted', float('nan')):>10.2f}x")
    print("  per-token latency P50/P90/P99 (ms):")
    for d, r in result["table1"].items():
        for name in ("ars", "sps"):
            t = r[f"{name}_token_ms"]
            print(f"    {d:<9}{name}: {t['p50']:.1f} / {t['p90']:.1f} / {t['p99']:.1f}")
    print(f"\nspeed-up model: c = {cost['c']:.3f} (draft {cost['draft_ms']:.1f} ms, target {cost['target_ms']:.1f} ms)"
          + (f", full-head c = {full_c:.3f}" if full_c else ""))
    print(f"{'K':>3}{'v(K)':>7}{'alpha':>7}{'accept eff':>11}{'ms/loop':>9}{'ms/' + str(args.max_new_tokens):>9}"
          f"{'predicted':>10}{'measured':>9}")
    for k, r in result["figure1"].items():
        v = cost["v"].get(k, 1.0)
        al = f"{r['alpha']:.3f}" if r["alpha"] is not None else "-"
        print(f"{k:>3}{v:>7.3f}{al:>7}{r['acceptance_efficiency']:>11.3f}{r['ms_per_loop']:>9.1f}"
              f"{r['time_s']['mean'] * 1e3:>9.0f}{r['predicted_speedup']:>9.2f}x{r['measured_speedup']:>8.2f}x")
    print(f"recommended K = {result['recommended_k']} (predicted {result['recommended_k_predicted']:.2f}x)")
    a = result.get("k_auto")
    if a:
        print(f"k=auto: measured {a['measured_speedup']:.2f}x (mean K {a['mean_k']:.1f}, alpha {a['alpha']:.3f}); "
              f"best fixed K {a['best_fixed_k']}: {a['best_fixed_speedup']:.2f}x")
    for d, r in result["table1"].items():
        gap = r["speedup_median"] / r["predicted_speedup"] - 1
        why = []
        if r["alpha"] < 0.6:
            why.append(f"alpha {r['alpha']:.2f} is low (the paper's drafts: ~0.7-0.8)")
        if cost["c"] > 0.1:
            why.append(f"c {cost['c']:.2f} is high (" + ("fewer draft layers" if args.draft_vocab else
                                                        "try --draft-vocab 4096") + ")")
        if cost["v"].get(args.k, 1) > 1.2:
            why.append(f"v({args.k}) {cost['v'][args.k]:.2f}: scoring K+1 tokens is not free here")
        print(f"  {d}: measured {gap:+.0%} vs predicted; " + ("; ".join(why) if why else "no obvious limiter"))


if __name__ == "__main__":
    sys.exit(main())
