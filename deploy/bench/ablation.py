"""The ablation's table and plot, read from a finished Hydra multirun: what trains the best draft at equal wall time.

    python train/draft.py -m recipe=shallow_wide hparams_search=ablation trainer.max_time=00:00:07:00
    draftsmith bench ablation multirun/DATE/TIME                 # -> ablation/{ablation.json,.md,.png}
    draftsmith bench ablation multirun/DATE/TIME --out DIR       # elsewhere
    draftsmith bench ablation --curve outputs/DATE/TIME          # alpha against training tokens of one run

Hydra runs the grid (`recipes/hparams_search/ablation.yaml`: data x loss x depth; narrow it on the command line,
e.g. `data=generated loss=distill_tv draft.layers=1,2,3`); each job is one run directory with its overrides and
report. A job that failed or is still running is left out and named. The right panel is the capacity frontier
(held-out acceptance against the draft's cost c, labelled with the predicted speed-up) when the grid varies depth.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from draftsmith.sampling.cli import examples

WINNER = {"data": "generated", "loss": "distill_tv"}  # the data grid's winner: the depth plot varies from it


def jobs(multirun: Path) -> list[tuple[dict, Path]]:
    """(the job's grid point, its run dir) of every finished job of a Hydra multirun directory, in job order."""
    import yaml

    out = []
    for d in sorted((p for p in multirun.iterdir() if (p / ".hydra" / "overrides.yaml").is_file()),
                    key=lambda p: int(p.name) if p.name.isdigit() else p.name):
        overrides = dict(o.split("=", 1) for o in yaml.safe_load((d / ".hydra" / "overrides.yaml").read_text()))
        cfg = yaml.safe_load((d / ".hydra" / "config.yaml").read_text())
        point = {"data": overrides.get("data", "fixed"), "loss": overrides.get("loss", "?"),
                 "draft.layers": int(overrides.get("draft.layers", cfg["draft"].get("layers") or 0))}
        if (d / "report.json").is_file():
            out.append((point, d))
        else:
            print(f"  {d.name} ({' '.join(f'{k}={v}' for k, v in overrides.items())}): no report.json (failed or "
                  "running): left out", file=sys.stderr)
    return out


def name_of(point: dict) -> str:
    return f"{point['data']}-{point['loss']}-L{point['draft.layers']}"


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


def row(point: dict, report: dict, run_dir: Path) -> dict:
    ev = report["eval"]["last"]
    v = report["cost"]["v"]
    k = report["sampler"]["k"]
    return {"name": name_of(point), **point, "c": report["c"], "k": k, "v": v[str(k)] if str(k) in v
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


def main(argv=None, prog=None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0], epilog=examples(__doc__),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("multirun", type=Path, nargs="?", help="a finished `-m` run's directory (multirun/DATE/TIME)")
    ap.add_argument("--out", type=Path, default=Path("ablation"),
                    help="where the table and plot go (default: %(default)s)")
    ap.add_argument("--curve", type=Path, help="plot alpha against training tokens of this run dir instead")
    args = ap.parse_args(argv)
    if args.curve:
        curve(args.curve, args.out)
        return 0
    if args.multirun is None or not args.multirun.is_dir():
        print(f"error: {args.multirun} is not a multirun directory: run `python train/draft.py -m "
              "recipe=shallow_wide hparams_search=ablation` first, then pass its multirun/DATE/TIME", file=sys.stderr)
        return 2
    found = jobs(args.multirun)
    if not found:
        print(f"error: no finished job (with a report.json) in {args.multirun}", file=sys.stderr)
        return 1
    rows = [row(p, json.loads((d / "report.json").read_text()), d) for p, d in found]
    first = json.loads((found[0][1] / "report.json").read_text())
    info = {k: v for k, v in first.items() if k in ("machine", "dtype", "training_precision", "sampler")}
    write(rows, args.out, run_minutes(found[0][1]), {**info, "multirun": str(args.multirun)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
