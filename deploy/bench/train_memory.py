"""Peak memory of a whole training run as its corpus grows: the teacher store streams, so it should stay flat.

    draftsmith bench train-memory                           # recipe=smoke, data=generated, 1x and 4x samples
    draftsmith bench train-memory --scales 1 4 16 -- draft=feature_head   # extra overrides after --

Each scale is one run from an empty cache in a fresh process (the target samples the corpus with its logits kept,
then trains a fixed number of steps over it), timed and measured by the peak RSS of its process tree. It prints
one row per scale: samples, training blocks, the kept store on disk, peak RSS, wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from draftsmith.sampling.cli import examples

# the run in a child whose own peak RSS (ru_maxrss of its waited children) is this run's alone
_MEASURE = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
            "print('MAXRSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, r.returncode)")


def one(scale: int, base_prompts: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "draftsmith.train.draft", "recipe=smoke", "data=generated",
               f"data.generated.n_prompts={base_prompts * scale}", "data.generated.samples_per_prompt=1",
               "data.generated.max_new_tokens=48", "data.max_documents=null", "trainer.max_steps=30",
               "trainer.val_check_interval=30", "logger=csv", f"hydra.run.dir={run}", *extra]
        env = {**os.environ, "DRAFTSMITH_HOME": str(Path(tmp) / "home"), "WANDB_MODE": "offline"}
        home_models = Path.home() / ".cache" / "draftsmith" / "models"
        if home_models.is_dir():  # the models, not the corpus: reuse what is converted already
            (Path(tmp) / "home").mkdir()
            (Path(tmp) / "home" / "models").symlink_to(home_models)
        t0 = time.perf_counter()
        res = subprocess.run([sys.executable, "-c", _MEASURE, *cmd], capture_output=True, text=True, env=env)
        wall = time.perf_counter() - t0
        tail = res.stdout.strip().splitlines()[-1].split()
        if tail[0] != "MAXRSS_KB" or tail[2] != "0":
            raise SystemExit(f"error: the run at scale {scale} failed:\n{res.stderr[-2000:]}")
        data = json.loads((run / "data.json").read_text())
        blocks = next(int(line.split()[3]) for line in res.stdout.splitlines() if "training blocks take" in line)
        store = sum(f.stat().st_size for f in (Path(tmp) / "home" / "generated").rglob("*.safetensors"))
        return {"scale": scale, "samples": data["rows"], "blocks": blocks, "store_mb": store / 2**20,
                "peak_rss_mb": int(tail[1]) / 1024, "wall_s": wall}


def main(argv=None, prog=None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0], epilog=examples(__doc__),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scales", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--n-prompts", type=int, default=64, help="prompts (one sample each) at scale 1")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("overrides", nargs="*", help="extra overrides for every run")
    args = ap.parse_args(argv)
    from draftsmith.sampling.machine import machine

    m = machine()
    print(f"{m['cpu']}, {m['cpu_capability']}, {m['threads']} threads, torch {m['torch']}")
    print(f"{'scale':>5} {'samples':>8} {'blocks':>7} {'store MB':>9} {'peak RSS MB':>12} {'wall s':>7}")
    rows = []
    for s in args.scales:
        r = one(s, args.n_prompts, args.overrides)
        rows.append(r)
        print(f"{r['scale']:>5} {r['samples']:>8} {r['blocks']:>7} {r['store_mb']:>9.1f} {r['peak_rss_mb']:>12.0f} "
              f"{r['wall_s']:>7.0f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": m, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
