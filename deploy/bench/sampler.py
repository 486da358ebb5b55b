"""Our sampler against transformers on the same pair, interleaved in one process.

    draftsmith bench sampler --target smollm2-135m             # the demo target, self-draft + 4-layer cut draft
    draftsmith bench sampler RUN_OR_BUNDLE --n-prompts 6 --max-new-tokens 128 --json bench.json
    draftsmith bench sampler --target smollm2-135m --compile --no-self-draft   # + our compiled decoding, c and v(K)
    draftsmith bench sampler --target random:llama3-8b-shape --cut-layers 3 --paper-draft   # + a paper-shaped draft

Rows: our ArS vs transformers `generate` (the baseline every speed-up is quoted against must not be slow),
and our SpS vs transformers assisted generation (`assistant_model=`, constant K, no confidence cut-off) with
the same draft. EOS is suppressed so every run produces exactly max_new_tokens. Each prompt runs every
configuration once, in a shuffled order; ratios are medians over prompts of per-prompt time ratios.
The cost model (c and v(K)) of every draft but the target itself is measured eagerly; with --compile, our loops
also run compiled (`compile=True`): every step shape is compiled by a warm-up run before any timing (the compile
times are printed), and c and v(K) are measured compiled too. --paper-draft adds the paper's draft shape for the
target (a tenth of its depth, three quarters of its width, `DraftConfig`'s defaults) with random weights: its
alpha means nothing, its c is what a trained draft of that shape costs.
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys

import torch

from draftsmith.drafts.build import truncated_target
from draftsmith.sampling import autoregressive_generate, speculative_generate
from draftsmith.sampling.cli import add_artifact, artifact_of, examples, locate_draft, target_of
from draftsmith.sampling.compiled import compile_report
from draftsmith.sampling.cost import measure_costs
from draftsmith.sampling.load import load_tokenizer
from draftsmith.sampling.machine import default_device, now, seeded, write_json
from draftsmith.sampling.precision import describe_run, run_info
from draftsmith.sampling.runtime import DTYPE_CHOICES, prepared_model
from draftsmith.sampling.stats import TAU, summary

PROMPTS = [
    "def merge_sort(items):\n    \"\"\"Sort a list with merge sort.\"\"\"\n",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class LRUCache:\n    def __init__(self, capacity):\n",
    "The history of the printing press begins",
    "Photosynthesis is the process by which plants",
    "for i in range(10):\n    if i % 2 == 0:\n",
    "A good night's sleep matters because",
    "def parse_args():\n    parser = argparse.ArgumentParser(",
]


def main(argv=None, prog=None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0], epilog=examples(__doc__),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_artifact(ap, "a bundle, a run dir or a draft checkpoint; default: the target cut to --cut-layers layers")
    ap.add_argument("--target", help="default: the artifact's target (a bundle's or run's); required otherwise")
    ap.add_argument("--cut-layers", type=int, default=4)
    ap.add_argument("--self-draft", action=argparse.BooleanOptionalAction, default=True,
                    help="also run the target as its own draft (alpha ~1): isolates each sampler's machinery")
    ap.add_argument("--paper-draft", action="store_true",
                    help="also run a random draft of the paper's shape for the target (its c and v(K); alpha ~0)")
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--n-prompts", type=int, default=4, help="prompts timed (each runs every configuration)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                    help="precision of both models (auto: the faster one for decoding on this machine, measured)")
    ap.add_argument("--compile", action="store_true",
                    help="also run our loops with compiled static-shape steps, and measure c and v(K) both ways")
    ap.add_argument("--device", default=default_device(),
                    help="where both models run (default: %(default)s; timings synchronise the device)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    rng = random.Random(0)

    try:
        args.draft = artifact_of(args)
        source = locate_draft(args.draft) if args.draft else None
        args.draft = source.path if source else None
        args.target = target_of(args.target, source)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tok = load_tokenizer(args.target)
    target = prepared_model(args.target, args.dtype, device=args.device)
    # default: the target's first N layers + final norm + head, the naive draft peers use (alpha ~0.05)
    first = (prepared_model(args.draft, args.dtype, device=args.device) if args.draft
             else truncated_target(target, args.cut_layers).to(target.dtype).eval().requires_grad_(False))
    drafts = {"draft" if args.draft else "cut": first}
    if args.paper_draft:
        from draftsmith.drafts.build import DraftConfig, build_draft

        drafts["paper"] = build_draft(target, DraftConfig()).to(target.dtype).eval().requires_grad_(False)
    if args.self_draft:
        drafts["self"] = target
    for d in drafts.values():
        d.generation_config.update(num_assistant_tokens=args.k, num_assistant_tokens_schedule="constant",
                                   assistant_confidence_threshold=0.0)
    # transformers' assisted generation ran the cut draft ~2x slower with frozen weights (cause not found; figures
    # in docs/results.md), while ours compiles frozen weights best: each gets its own copy
    assistants = {name: copy.deepcopy(d).requires_grad_(True) for name, d in drafts.items()}
    N, T, P = args.max_new_tokens, args.temperature, args.top_p
    hf_common = dict(max_new_tokens=N, min_new_tokens=N, do_sample=T > 0, pad_token_id=tok.eos_token_id)
    if T > 0:
        hf_common.update(temperature=T, top_p=P, top_k=0)

    modes = {"": False, "_compiled": True} if args.compile else {"": False}
    configs = {}
    for suffix, comp in modes.items():
        configs[f"ours_ars{suffix}"] = (lambda comp: lambda ids, g: autoregressive_generate(
            target, ids, max_new_tokens=N, temperature=T, top_p=P, generator=g, compile=comp))(comp)
    configs["hf_generate"] = lambda ids, g: target.generate(ids, **hf_common)
    for name, d in drafts.items():
        for suffix, comp in modes.items():
            configs[f"ours_sps_{name}{suffix}"] = (lambda d, comp: lambda ids, g: speculative_generate(
                target, d, ids, max_new_tokens=N, k=args.k, temperature=T, top_p=P, generator=g, compile=comp))(d, comp)
        configs[f"hf_assisted_{name}"] = (lambda d: lambda ids, g: target.generate(ids, assistant_model=d,
                                                                                   **hf_common))(assistants[name])

    prompts = (PROMPTS * ((args.n_prompts + len(PROMPTS) - 1) // len(PROMPTS)))[: args.n_prompts]
    times = {c: [] for c in configs}
    extra = {c: [] for c in configs}
    costs = {}
    with torch.inference_mode():
        warm = tok(prompts[0], return_tensors="pt").input_ids.to(args.device)
        target(warm)  # warm-up
        for c in configs:  # compiled configs compile every shape they meet here, outside the timing
            if c.endswith("_compiled"):
                configs[c](warm, seeded(warm.device, 0))
        for name, d in drafts.items():
            if d is target:  # c = 1 by definition
                continue
            for suffix, comp in modes.items():
                costs[f"{name}{suffix}"] = measure_costs(target, d, ks=range(1, args.k + 1), compile=comp)
        for i, prompt in enumerate(prompts):
            ids = tok(prompt, return_tensors="pt").input_ids.to(args.device)
            order = list(configs)
            rng.shuffle(order)
            for c in order:
                t = now(ids.device)
                out = configs[c](ids, seeded(ids.device, i))
                times[c].append(now(ids.device) - t)
                if hasattr(out, "stats"):
                    extra[c].append(out.stats.to_dict())
            print(f"prompt {i + 1}/{len(prompts)} done", flush=True)

    rows = {}
    for c, ts in times.items():
        ms_tok = [1e3 * t / N for t in ts]
        row = {"tokens_per_s": N / statistics.median(ts), "ms_per_token": summary(ms_tok)}
        if extra[c] and extra[c][0]["alpha"] is not None:
            row["alpha"] = statistics.mean(s["alpha"] for s in extra[c])
            row["tokens_per_call"] = statistics.mean(s["tokens_per_call"] for s in extra[c])
        rows[c] = row

    def ratio(a, b):  # median over prompts of time(b) / time(a): > 1 means a is faster
        return statistics.median(tb / ta for ta, tb in zip(times[a], times[b]))

    ratios = {"ours_ars_vs_hf_generate": ratio("ours_ars", "hf_generate")}
    if args.compile:
        ratios["ours_ars_compiled_vs_hf_generate"] = ratio("ours_ars_compiled", "hf_generate")
        ratios["ours_ars_compiled_vs_ours_ars"] = ratio("ours_ars_compiled", "ours_ars")
    for name in drafts:
        for suffix in modes:
            ratios[f"ours_sps_{name}{suffix}_vs_hf_assisted_{name}"] = ratio(f"ours_sps_{name}{suffix}",
                                                                              f"hf_assisted_{name}")
            ratios[f"ours_sps_{name}{suffix}_vs_ours_ars{suffix}"] = ratio(f"ours_sps_{name}{suffix}",
                                                                            f"ours_ars{suffix}")
        ratios[f"hf_assisted_{name}_vs_hf_generate"] = ratio(f"hf_assisted_{name}", "hf_generate")
        if args.compile:
            ratios[f"ours_sps_{name}_compiled_vs_ours_sps_{name}"] = ratio(f"ours_sps_{name}_compiled",
                                                                            f"ours_sps_{name}")

    info = run_info(target=target, draft=first)
    print(f"\nmeasured on: {describe_run(info)}")
    print(f"{args.target}, K={args.k}, T={T}, top-p={P}, {N} new tokens, {len(prompts)} prompts; tau: {TAU}")
    print(f"{'config':<26}{'tok/s':>8}{'ms/tok mean':>12}{'p50':>8}{'p90':>8}{'p99':>8}{'alpha':>8}{'tau':>9}")
    for c, r in rows.items():
        m = r["ms_per_token"]
        a = f"{r['alpha']:.3f}" if "alpha" in r else "-"
        tpc = f"{r['tokens_per_call']:.2f}" if "tokens_per_call" in r else "-"
        print(f"{c:<26}{r['tokens_per_s']:>8.1f}{m['mean']:>12.1f}{m['p50']:>8.1f}{m['p90']:>8.1f}{m['p99']:>8.1f}"
              f"{a:>8}{tpc:>9}")
    print("\nspeed ratios (median over prompts, > 1 = first is faster):")
    for k, v in ratios.items():
        print(f"  {k:<50}{v:.3f}")
    if args.compile:
        print("\ncompile time of each step shape (seconds, once per process):")
        for r in compile_report():
            print(f"  {r['model']:<36} {r['rows']} x {r['tokens']:<3} tokens {r['compile_s']:>7.1f}")
    print("\ncost model of each draft: c = draft step / target step, v(K) = (K+1)-token pass / 1-token pass")
    for name, cost in costs.items():
        vs = "  ".join(f"v({kk})={v:.2f}" for kk, v in cost["v"].items())
        print(f"  {name:<16} target {cost['target_ms']:6.1f} ms  draft {cost['draft_ms']:6.1f} ms  "
              f"c={cost['c']:.3f}  {vs}")
    result = {"args": vars(args), **info, "rows": rows, "ratios": ratios, "costs": costs,
              "compile_report": compile_report()}
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
