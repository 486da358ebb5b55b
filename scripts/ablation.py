"""What trains the best draft at equal wall time: data source x loss, and draft depth (the capacity frontier).

    python scripts/ablation.py --minutes 10                      # the full grid, ~10 min of training per run
    python scripts/ablation.py --minutes 5 --only data loss      # a subset of the grids
    python scripts/ablation.py --plot-only                       # redraw docs/ablation from finished runs
    python scripts/ablation.py --curve outputs/DATE/TIME         # alpha against training tokens of one run

Each run is `python train/draft.py recipe=shallow_wide` with one change, time-boxed by `trainer.max_time` (the LR
schedule follows time, so every run anneals fully), validated only when time is up (its time goes to training),
and the run's report: alpha from the real sampler and `alpha_on_target` (teacher-forced on the
target's own samples, noise-free) on the shipped `code` and `english` prompt sets, and c. Finished runs are
skipped, so an interrupted ablation resumes. Results: docs/ablation/{ablation.json, ablation.md, ablation.png}.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WINNER = {"data": "generated", "loss": "distill_tv"}  # the data grid's winner: the loss and depth grids vary from it
GRIDS = {
    "data": [{"data": d, "loss": "distill_tv"} for d in ("fixed", "generated", "on_policy", "mixed")],
    "loss": [{**WINNER, "loss": loss} for loss in ("forward_kl", "jsd")],
    "capacity": [{**WINNER, "draft.layers": n} for n in (1, 2, 4, 6)],
}
BASE = {"recipe": "shallow_wide", "data": "fixed", "loss": "distill_tv", "draft.layers": 3}


def name_of(change: dict) -> str:
    cfg = {**BASE, **change}
    return f"{cfg['data']}-{cfg['loss']}-L{cfg['draft.layers']}"


def run(change: dict, minutes: float, runs_dir: Path, extra: list[str]) -> dict | None:
    out = runs_dir / name_of(change)
    report = out / "report.json"
    if report.is_file():
        return json.loads(report.read_text())
    cfg = {**BASE, **change}
    m = int(minutes)
    overrides = [f"{k}={v}" for k, v in cfg.items()] + [
        f"trainer.max_time=00:00:{m:02d}:{int(round((minutes - m) * 60)):02d}", "trainer.max_steps=1000000",
        "trainer.val_check_interval=1000000", "eval.baseline=false", "logger=csv",
        f"hydra.run.dir={out}", *extra]
    print(f"[{time.strftime('%H:%M:%S')}] {name_of(change)}: {' '.join(overrides)}", flush=True)
    with (runs_dir / f"{name_of(change)}.log").open("w") as log:
        res = subprocess.run([sys.executable, str(ROOT / "train" / "draft.py"), *overrides], stdout=log,
                             stderr=subprocess.STDOUT, cwd=ROOT, env=dict(os.environ, WANDB_MODE="offline"))
    if res.returncode != 0 or not report.is_file():
        print(f"  failed (exit {res.returncode}); see {runs_dir / name_of(change)}.log", flush=True)
        return None
    return json.loads(report.read_text())


def steps_done(run_dir: Path) -> int:
    """Optimiser steps the run made in its time (the checkpoint is named after the last one)."""
    ckpts = [p.name for p in (run_dir / "checkpoints").glob("step*-*.ckpt")]
    return max((int(n[4:n.index("-")]) for n in ckpts), default=0)


def run_minutes(run_dir: Path) -> float:
    """The training time a finished run was given (`trainer.max_time` of its Hydra config, DD:HH:MM:SS; read as
    text: YAML 1.1 reads an unquoted 01:00:00:00 as a base-60 integer)."""
    text = (run_dir / ".hydra" / "config.yaml").read_text()
    d, h, m, s = (int(x) for x in re.search(r"max_time: *['\"]?(\d+:\d+:\d+:\d+)", text).group(1).split(":"))
    return (d * 24 + h) * 60 + m + s / 60


def row(change: dict, report: dict, run_dir: Path) -> dict:
    ev = report["eval"]["last"]
    v = report["cost"]["v"]
    k = report["sampler"]["k"]
    return {"name": name_of(change), **{**BASE, **change}, "c": report["c"], "k": k, "v": v[str(k)] if str(k) in v
            else v[k], "wall_s": report["wall_s"], "steps": steps_done(run_dir),
            **{f"{ps}_{k}": ev[ps][k] for ps in ev for k in ("alpha", "alpha_on_target", "tokens_per_call")}}


def write(rows: list[dict], out: Path, minutes: float, info: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "ablation.json").write_text(json.dumps({"minutes_per_run": minutes, **info, "runs": rows}, indent=2))
    head = ("| run | data | loss | layers | code alpha | code alpha_on_target | english alpha | "
            "english alpha_on_target | c | steps in the time |")
    lines = [head, "|" + " --- |" * 10]
    for r in rows:
        lines.append(f"| {r['name']} | {r['data']} | {r['loss']} | {r['draft.layers']} | {r['code_alpha']:.3f} | "
                     f"{r['code_alpha_on_target']:.3f} | {r['english_alpha']:.3f} | "
                     f"{r['english_alpha_on_target']:.3f} | {r['c']:.3f} | {r['steps']} |")
    (out / "ablation.md").write_text("\n".join(lines) + "\n")
    plot(rows, out / "ablation.png", minutes)
    print("\n".join(lines))


def plot(rows: list[dict], path: Path, minutes: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    names = [r["name"] for r in rows]
    x = range(len(rows))
    for off, ps, color in ((-0.2, "code", "tab:blue"), (0.2, "english", "tab:orange")):
        axes[0].bar([i + off for i in x], [r[f"{ps}_alpha_on_target"] for r in rows], 0.4, label=ps, color=color)
        axes[0].scatter([i + off for i in x], [r[f"{ps}_alpha"] for r in rows], color="black", s=12, zorder=3)
    axes[0].set_xticks(list(x), names, rotation=35, ha="right", fontsize=8)
    axes[0].set_ylabel("alpha_on_target (bars), sampled alpha (dots)")
    axes[0].set_title(f"data x loss x depth, {minutes:g} min of training each")
    axes[0].legend()
    cap = sorted((r for r in rows if r["data"] == WINNER["data"] and r["loss"] == WINNER["loss"]),
                 key=lambda r: r["draft.layers"])
    if len({r["draft.layers"] for r in cap}) >= 2:
        from draftsmith.sampling.cost import predicted_speedup

        ax = axes[1]
        for ps, color in (("code", "tab:blue"), ("english", "tab:orange")):
            ax.plot([r["c"] for r in cap], [r[f"{ps}_alpha_on_target"] for r in cap], "o-", color=color, label=ps)
            for r in cap:
                s = predicted_speedup(r[f"{ps}_alpha_on_target"], r["k"], r["c"], r["v"])
                ax.annotate(f"L{r['draft.layers']} {s:.2f}x", (r["c"], r[f"{ps}_alpha_on_target"]), fontsize=7)
        ax.set_xlabel("c (draft step / target step, measured)")
        ax.set_ylabel("alpha_on_target")
        ax.set_title(f"capacity frontier ({WINNER['data']}, {WINNER['loss']}); labels: predicted speed-up at "
                     f"K={cap[0]['k']}")
        ax.legend()
    else:  # no capacity runs: what each data source cost, in optimiser steps done in the same time
        ax = axes[1]
        for r in rows:
            ax.scatter(r["steps"], r["code_alpha_on_target"], color="tab:blue")
            ax.scatter(r["steps"], r["english_alpha_on_target"], color="tab:orange")
            ax.annotate(r["name"], (r["steps"], r["code_alpha_on_target"]), fontsize=7)
        ax.set_xlabel(f"optimiser steps done in {minutes:g} min")
        ax.set_ylabel("alpha_on_target (blue: code, orange: English)")
        ax.set_title("cost of each data source at equal wall time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def curve(run_dir: Path, out: Path) -> None:
    """val/alpha_on_target (and val/alpha) against training tokens of one run: does it saturate?"""
    import csv

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = json.loads((run_dir / "report.json").read_text())
    rows = list(csv.DictReader((run_dir / "csv" / "metrics.csv").open()))
    tokens_per_step = None
    hydra_cfg = run_dir / ".hydra" / "config.yaml"
    if hydra_cfg.is_file():
        import yaml

        d = yaml.safe_load(hydra_cfg.read_text())["data"]
        tokens_per_step = d["batch_size"] * d["block_size"]
    points = [(int(r["step"]) * tokens_per_step, float(r["val/alpha_on_target"]),
               float(r["val/alpha"]) if r.get("val/alpha") else None) for r in rows if r.get("val/alpha_on_target")]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.plot([p[0] for p in points], [p[1] for p in points], "o-", label="val/alpha_on_target")
    ax.plot([p[0] for p in points], [p[2] for p in points], "s--", alpha=0.6, label="val/alpha (sampler)")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("alpha")
    ax.set_title(f"{run_dir.name}: acceptance against training tokens")
    ax.legend()
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "curve.png", dpi=110)
    (out / "curve.json").write_text(json.dumps({"run": run_dir.name, **{k: report[k] for k in ("machine", "dtype")},
                                                "points": [{"tokens": t, "alpha_on_target": a, "alpha": s}
                                                           for t, a, s in points]}, indent=2))
    for t, a, s in points:
        print(f"{t:>9} tokens  val/alpha_on_target {a:.3f}  val/alpha {s:.3f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="training wall time per run")
    ap.add_argument("--only", nargs="+", choices=list(GRIDS), default=list(GRIDS))
    ap.add_argument("--runs", type=Path, default=ROOT / "outputs" / "ablation")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "ablation")
    ap.add_argument("--plot-only", action="store_true", help="collect finished runs, start none")
    ap.add_argument("--curve", type=Path, help="plot alpha against training tokens of this run dir, start none")
    ap.add_argument("overrides", nargs="*", help="extra overrides for every run (e.g. data.prompts=train)")
    args = ap.parse_args(argv)
    if args.curve:
        curve(args.curve, args.out)
        return 0
    if args.minutes <= 0:
        print("error: --minutes must be > 0", file=sys.stderr)
        return 2
    args.runs.mkdir(parents=True, exist_ok=True)
    changes = [c for g in args.only for c in GRIDS[g]]
    changes = [c for i, c in enumerate(changes) if name_of(c) not in {name_of(d) for d in changes[:i]}]
    if "data" not in args.only:  # every grid compares against the default cell
        changes.insert(0, dict(WINNER))
    rows = []
    for change in changes:
        report = None
        if args.plot_only:
            p = args.runs / name_of(change) / "report.json"
            report = json.loads(p.read_text()) if p.is_file() else None
        else:
            report = run(change, args.minutes, args.runs, args.overrides)
        if report:
            rows.append(row(change, report, args.runs / name_of(change)))
    if not rows:
        print("error: no finished run to report", file=sys.stderr)
        return 1
    info = {k: v for k, v in json.loads((args.runs / rows[0]["name"] / "report.json").read_text()).items()
            if k in ("machine", "dtype", "training_precision", "sampler")}
    minutes = run_minutes(args.runs / rows[0]["name"]) if args.plot_only else args.minutes
    write(rows, args.out, minutes, {**info, "overrides": args.overrides})
    return 0


if __name__ == "__main__":
    sys.exit(main())
