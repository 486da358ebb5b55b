"""Which engine samples the target's corpus faster on this machine: our loop or vLLM, on the same prompts and settings.

    draftsmith bench corpus --target smollm2-135m             # the demo target, 64 broad prompts, 192 tokens
    draftsmith bench corpus --target DIR --batch-size 256 --max-new-tokens 256 --json out.json

Each engine samples one batch of the `broad` prompts at the recipe's T 0.8, top-p 0.95 (vLLM in its own venv,
`draftsmith engines install vllm`; its start is timed apart, it is paid once a run). It prints tokens/s of each and
the start, and what `data.generated.engine=auto` would choose from them.
"""

from __future__ import annotations

import argparse
import sys
import time

from draftsmith.data.generation import own_batches
from draftsmith.engines import vllm
from draftsmith.sampling.cli import examples
from draftsmith.sampling.load import load_tokenizer
from draftsmith.sampling.machine import machine, write_json
from draftsmith.sampling.prompts import load_prompts, pad_id, prompt_rows
from draftsmith.sampling.runtime import DTYPE_CHOICES, prepared_model


def main(argv=None, prog=None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0], epilog=examples(__doc__),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", help="the target that samples (required: an alias, hub id, directory or .gguf)")
    ap.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    if not args.target:
        print("error: no target: pass --target NAME (a hub id, a checkpoint directory, a .gguf, or smollm2-135m for "
              "the demo)", file=sys.stderr)
        return 2

    tok, target = load_tokenizer(args.target), prepared_model(args.target, args.dtype, role="teacher")
    rows = prompt_rows(tok, [r["prompt"] for r in load_prompts("broad", args.batch_size)])
    common = dict(seed=0, first_row=0, max_new_tokens=args.max_new_tokens, temperature=0.8, top_p=0.95,
                  eos=tok.eos_token_id)
    res = {"machine": machine(), "target": args.target, "dtype": str(target.dtype), "batch": len(rows),
           "max_new_tokens": args.max_new_tokens}
    for engine in ("draftsmith", "vllm"):
        if engine == "vllm" and vllm.missing():
            print(f"vllm: not installed ({vllm.INSTALL})")
            continue
        t0 = time.perf_counter()
        batches = (own_batches(target, rows, len(rows), pad=pad_id(tok), **common) if engine == "draftsmith" else
                   vllm.batches(args.target, target.dtype, rows, len(rows), **common))
        _, _, tokens, _, seconds = next(batches)
        wall = time.perf_counter() - t0
        batches.close()
        n = sum(len(t) for t in tokens)
        res[engine] = {"tokens": n, "seconds": seconds, "tokens_per_s": n / seconds, "wall_s": wall}
        print(f"{engine:>10}: {n} tokens in {seconds:.1f} s = {n / seconds:.0f} tokens/s "
              f"(wall with the engine's start {wall:.1f} s)")
    rates = {e: res[e]["tokens_per_s"] for e in ("draftsmith", "vllm") if e in res}
    print(f"data.generated.engine=auto would choose: {max(rates, key=rates.get)}  "
          f"({res['machine']['cpu']}, {res['dtype']}, batch {len(rows)})")
    if args.json:
        write_json(args.json, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
