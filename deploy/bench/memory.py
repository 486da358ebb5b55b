"""Peak memory of a long speculative generation (batch 16, 250 and 1,000 new tokens a row) against the KV caches it
must hold (target and draft): what grows beyond them is a leak.

    draftsmith bench memory outputs/DATE/TIME                      # a run: its best draft and its target
    draftsmith bench memory tiny-random --target tiny-random --tokens 50 200   # a quick look

Each length runs in a fresh process, since the peak RSS (`ru_maxrss`) of a process never goes down.
"""

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

from draftsmith.sampling.cli import add_artifact, artifact_of, examples, locate_draft, target_of
from draftsmith.sampling.runtime import DTYPE_CHOICES


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _kv_bytes_per_token(model) -> int:
    """Keys and values of every layer for one position (a feature draft: its one layer)."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    layers = getattr(c, "num_hidden_layers", 1)
    return 2 * layers * c.num_key_value_heads * head_dim * model.dtype.itemsize


def child(target_name: str, draft_name: str, tokens: int, batch: int, k: int, dtype: str) -> dict:
    from draftsmith.sampling import speculative_generate
    from draftsmith.sampling.load import load_tokenizer
    from draftsmith.sampling.runtime import prepared_model

    target, draft = prepared_model(target_name, dtype), prepared_model(draft_name, dtype)
    tok = load_tokenizer(target_name)
    ids = tok(["def parse(line):"] * batch, return_tensors="pt").input_ids
    loaded = _rss_mb()
    t0 = time.perf_counter()
    with torch.inference_mode():  # no EOS: every row runs the full length
        gen = speculative_generate(target, draft, ids, max_new_tokens=tokens, k=k, temperature=0.8, top_p=0.95,
                                   generator=torch.Generator().manual_seed(0))
    positions = ids.shape[1] + tokens + k
    kv_mb = sum(batch * positions * _kv_bytes_per_token(m) for m in (target, draft)) / 2**20
    return {"tokens": tokens, "batch": batch, "k": k, "loaded_mb": loaded, "peak_mb": _rss_mb(),
            "kv_mb": kv_mb, "seconds": time.perf_counter() - t0,
            "new_tokens": sum(len(t) for t in gen.tokens), "alpha": gen.stats.alpha}


def main(argv=None, prog=None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0], epilog=examples(__doc__),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_artifact(ap)
    ap.add_argument("--target", help="default: the artifact's target (a bundle's or run's); required otherwise")
    ap.add_argument("--tokens", type=int, nargs="+", default=[250, 1000])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--dtype", choices=DTYPE_CHOICES, default="fp32")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        source = locate_draft(artifact_of(args, required=True))
        args.draft, args.target = source.path, target_of(args.target, source)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.child:
        print(json.dumps(child(args.target, args.draft, args.child, args.batch, args.k, args.dtype)))
        return 0
    from draftsmith.sampling.machine import machine

    print(f"{machine()['cpu']}, {args.dtype}, batch {args.batch}, K {args.k}")
    print(f"{'tokens':>7} {'RSS loaded MB':>14} {'peak RSS MB':>12} {'growth MB':>10} {'KV caches MB':>13} "
          f"{'beyond KV MB':>13} {'seconds':>8}")
    for n in args.tokens:
        cmd = [sys.executable, "-m", "draftsmith.deploy.bench.memory", "--target", args.target, "--draft", args.draft,
               "--child", str(n),
               "--batch", str(args.batch), "-k", str(args.k), "--dtype", args.dtype]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            print(f"error: the {n}-token run failed: {res.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            return 2
        r = json.loads(res.stdout.strip().splitlines()[-1])
        growth = r["peak_mb"] - r["loaded_mb"]
        print(f"{n:>7} {r['loaded_mb']:>14.0f} {r['peak_mb']:>12.0f} {growth:>10.0f} {r['kv_mb']:>13.0f} "
              f"{growth - r['kv_mb']:>13.0f} {r['seconds']:>8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
