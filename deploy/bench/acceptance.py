"""Drafts judged side by side on the same samples of their target: `alpha_on_target` per prompt set, teacher-forced
on one set of the target's own continuations, so no draft meets other samples than another (a run's report samples
its own, with its own seed) and no sampling noise enters.

    draftsmith bench acceptance outputs/A outputs/B --prompts chat code english --n-prompts 32
    draftsmith bench acceptance RUN1 RUN2 --json acceptance.json

`chat` is the held-out ShareGPT split's first turns through the target's chat template (never trained on); `code`
and `english` the shipped raw openings. Each set's continuations are sampled once at the sampler's settings
(T 0.8, top-p 0.95, unless the first artifact says otherwise or the flags do), then every draft is scored on them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from draftsmith.sampling.cli import add_artifact, artifact_of, draft_label, examples, locate_draft, target_of
from draftsmith.sampling.load import load_tokenizer
from draftsmith.sampling.machine import default_device, device_of
from draftsmith.sampling.probs import SamplingConfig
from draftsmith.sampling.prompts import encode_prompts, load_prompts, pad_id
from draftsmith.sampling.runtime import DTYPE_CHOICES, prepared_model


def main(argv=None, prog=None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0], epilog=examples(__doc__),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_artifact(ap, "run dir(s), bundle(s) or draft checkpoint dir(s), all for the same target", many=True)
    ap.add_argument("--target", help="default: the first artifact's target (a bundle's or run's); required otherwise")
    ap.add_argument("--prompts", nargs="+", default=["chat", "code", "english"],
                    help="chat (held-out ShareGPT, through the template), code, english, or JSONL files (`prompt`)")
    ap.add_argument("--n-prompts", type=int, default=32, help="per set")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="the target's continuation of each prompt")
    ap.add_argument("-k", type=int, default=4, help="K (a feature draft's alpha is the mean over its K steps)")
    ap.add_argument("--temperature", type=float, help="default: the first artifact's, else 0.8")
    ap.add_argument("--top-p", type=float, help="default: the first artifact's, else 0.95")
    ap.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                    help="precision of both models (auto: the faster one on this machine, measured)")
    ap.add_argument("--seed", type=int, default=0, help="the target's samples")
    ap.add_argument("--device", default=default_device(), help="where both models run (default: %(default)s)")
    ap.add_argument("--json", help="write the table here too")
    args = ap.parse_args(argv)
    from draftsmith.drafts.evaluate import CHAT_SET, alpha_on_samples, chat_prompts, target_samples

    try:
        sources = [locate_draft(d) for d in artifact_of(args, required=True)]
        target_name = target_of(args.target, sources[0])
        s = sources[0].sampling
        cfg = SamplingConfig(args.temperature if args.temperature is not None else s.get("temperature", 0.8), 0,
                             args.top_p if args.top_p is not None else s.get("top_p", 0.95))
        tok = load_tokenizer(target_name)
        target = prepared_model(target_name, args.dtype, device=args.device)
        drafts = {}
        for src in sources:
            drafts[draft_label(src.path, drafts)] = prepared_model(src.path, args.dtype, device=args.device)
        sets = {}
        for ps in args.prompts:
            texts, special = ((chat_prompts(tok, args.n_prompts), False) if ps == CHAT_SET else
                              ([r["prompt"] for r in load_prompts(ps, args.n_prompts)], True))
            sets[ps] = [t.to(device_of(target)) for t in encode_prompts(tok, texts, special_tokens=special)]
    except ValueError as e:  # a DraftsmithError, or bad input
        print(f"error: {e}", file=sys.stderr)
        return 2
    table = {name: {} for name in drafts}
    with torch.inference_mode():
        for ps, (ids, mask) in sets.items():
            print(f"{ps}: the target continues {len(ids)} prompts by {args.max_new_tokens} tokens...", file=sys.stderr)
            samples = target_samples(target, ids, mask, max_new_tokens=args.max_new_tokens,
                                     temperature=cfg.temperature, top_p=cfg.top_p, eos_token_id=tok.eos_token_id,
                                     pad_token_id=pad_id(tok), seed=args.seed)
            for name, draft in drafts.items():
                table[name][ps] = alpha_on_samples(target, draft, samples, cfg, k=args.k)
    sizes = {ps: len(ids) for ps, (ids, _) in sets.items()}  # a shipped set may hold fewer than --n-prompts
    print(f"alpha_on_target at T={cfg.temperature}, top-p={cfg.top_p}, K={args.k}: every draft on the same "
          f"{args.max_new_tokens}-token continuations by {target_name} of "
          + ", ".join(f"{n} {ps}" for ps, n in sizes.items()) + " prompts")
    width = max(len(n) for n in table) + 2
    print(f"{'draft':<{width}}" + "".join(f"{ps:>10}" for ps in args.prompts))
    for name, row in table.items():
        print(f"{name:<{width}}" + "".join(f"{row[ps]:>10.4f}" for ps in args.prompts))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "target": target_name, "temperature": cfg.temperature, "top_p": cfg.top_p, "k": args.k,
            "prompts": sizes, "max_new_tokens": args.max_new_tokens, "seed": args.seed,
            "drafts": {n: src.path for n, src in zip(table, sources)}, "alpha_on_target": table}, indent=2))
    return 0

