"""Peak memory of the teacher store as the corpus grows: it should stay flat (the kept logits and features live on
disk, one record per block, read per batch).

    draftsmith bench store                       # the demo's shapes: 255 positions, top-128, features 3 x 576
    draftsmith bench store --blocks 500 2000 --features 0

Each size runs in a fresh process: fill every block (as the prefill from the target's kept logits does), then read
one epoch in batches of 4 (as training does). It prints the peak RSS of each, and the bytes the same blocks would
take held in memory (the layout before the store).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time

import torch

from draftsmith.sampling.cli import examples


def one(blocks: int, positions: int, k: int, features: int, vocab: int, batch: int) -> dict:
    from draftsmith.data.teacher import TeacherCache

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        cache = TeacherCache(blocks, positions, k, vocab, features=features, directory=tmp)
        g = torch.Generator().manual_seed(0)
        for lo in range(0, blocks, 16):
            rows = torch.arange(lo, min(lo + 16, blocks))
            logits = torch.randn(len(rows), positions, vocab, generator=g)
            feats = torch.randn(len(rows), positions, features, generator=g) if features else None
            cache._store(rows, logits, feats)
            del logits, feats
        fill_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        for lo in range(0, blocks, batch):
            cache.outputs(torch.arange(lo, min(lo + batch, blocks)), teacher=None)
        read_s = time.perf_counter() - t1
    return {"blocks": blocks, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "in_memory_mb": blocks * cache.record / 2**20, "fill_s": fill_s, "epoch_read_s": read_s}


def main(argv=None, prog=None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0], epilog=examples(__doc__),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, nargs="+", default=[500, 2000])
    ap.add_argument("--positions", type=int, default=255)
    ap.add_argument("--top-k", type=int, default=128, help="kept entries a position (loss.teacher_topk)")
    ap.add_argument("--features", type=int, default=3 * 576)
    ap.add_argument("--vocab", type=int, default=8192, help="the logits drawn to fill the store (its cost only)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(one(a.child, a.positions, a.top_k, a.features, a.vocab, a.batch)))
        return 0
    from draftsmith.sampling.machine import machine

    m = machine()
    print(f"{m['cpu']}, {m['threads']} threads; {a.positions} positions x top-{a.top_k}, {a.features} feature values")
    print(f"{'blocks':>8} {'peak RSS MB':>12} {'held in memory MB':>18} {'fill s':>8} {'epoch read s':>13}")
    for n in a.blocks:
        args = [sys.executable, "-m", "draftsmith.deploy.bench.store", "--child", str(n), "--positions",
                str(a.positions), "--top-k", str(a.top_k), "--features", str(a.features), "--vocab", str(a.vocab),
                "--batch", str(a.batch)]
        r = json.loads(subprocess.run(args, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
        print(f"{r['blocks']:>8} {r['peak_rss_mb']:>12.0f} {r['in_memory_mb']:>18.0f} {r['fill_s']:>8.1f} "
              f"{r['epoch_read_s']:>13.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
