"""The bundle's card as pictures: what export measured (acceptance by draft position, predicted speed-up by K) and
what `deploy_check` found in each engine (speed-up and verdict). PNGs beside README.md, embedded in it."""

from __future__ import annotations

from pathlib import Path

from draftsmith.drafts.plots import acceptance_by_position

CARD_PLOT = "acceptance.png"
DEPLOYMENT_PLOT = "deployment.png"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a training node
    import matplotlib.pyplot as plt

    return plt


def card_plot(spec: dict, path: Path) -> None:
    """Left: acceptance at each draft position, given the position was reached, per prompt set, against alpha (the
    paper's i.i.d. assumption makes it flat, and tokens per call follow from alpha alone). Right: the speed-up
    predicted from alpha, c and v(K) for each K measured, the recommended K marked."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    acceptance_by_position(left, spec["acceptance"])
    ks = sorted(int(k) for k in spec["predicted_speedup"])
    right.plot(ks, [spec["predicted_speedup"][str(k)] for k in ks], "s-")
    k = spec["recommended_k"]
    right.scatter([k], [spec["predicted_speedup"][str(k)]], s=120, facecolors="none", edgecolors="red",
                  label=f"recommended K={k}")
    right.axhline(1.0, color="grey", lw=0.8)
    right.set_xlabel("K (draft tokens per target call)")
    right.set_ylabel("predicted speed-up")
    right.set_title(f"c = {spec['c']:.3f} of a target step")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def deployment_plot(deployment: dict, path: Path) -> None:
    """Speed-up of each engine's speculative decoding over its plain decoding, per setting: green where
    `deploy_check` found it lossless, red where it did not; hatched bars are variants timed beside (a quantized
    draft), not judged."""
    plt = _pyplot()
    bars = []  # (label, speed-up, colour, hatch)
    for engine, rep in deployment.items():
        for setting, r in rep["settings"].items():
            colour = "tab:green" if r["verdict"] == "pass" else "tab:red"
            bars.append((f"{engine}\n{setting}", r["speedup"], colour, None))
            for label, v in r.get("variants", {}).items():
                bars.append((f"{engine}, {label}\n{setting}", v["speedup"], colour, "//"))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(bars)), 3.8))
    for i, (label, x, colour, hatch) in enumerate(bars):
        ax.bar(i, x, color=colour, hatch=hatch, edgecolor="black", alpha=0.8)
        ax.text(i, x, f"{x:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(bars)), [b[0] for b in bars], fontsize=7)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("tokens/s speculative / plain")
    cpu = next(iter(deployment.values()))["machine"].get("cpu", "")
    ax.set_title(f"deploy_check: green lossless, red not ({cpu})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
