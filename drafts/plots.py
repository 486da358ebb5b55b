"""A run's acceptance as pictures: its validation curves and final drafts (`plot_report`, OUT_DIR/acceptance.png)
and acceptance by draft position, which the bundle's card draws too (`acceptance_by_position`). matplotlib is
imported when a picture is drawn, files only (no display on a training node)."""

from __future__ import annotations

from pathlib import Path


def plot_report(report: dict, path: Path) -> None:
    """The run at a glance: acceptance at each validation (left), the final drafts' acceptance on each prompt set,
    sampled and teacher-forced on the target's samples, against the cut-target baseline (middle), and the best
    draft's acceptance at each draft position (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right, third) = plt.subplots(1, 3, figsize=(17, 4.2))
    hist = report["validation_history"]
    for key, style in (("val/alpha_on_target", "o-"), ("val/alpha", "s--"), ("val/alpha_analytic", "^:")):
        pts = [(h["step"], h[key]) for h in hist if key in h]
        if pts:
            left.plot(*zip(*pts), style, label=key)
    left.set_xlabel("step")
    left.set_ylabel("acceptance")
    left.set_title(f"validation ({report['monitor']} best {report['best_score'] or float('nan'):.3f})")
    left.legend()
    names, sets = list(report["eval"]), sorted({ps for r in report["eval"].values() for ps in r})
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(sets))]
        right.bar(xs, [report["eval"][name][ps]["alpha_on_target"] for ps in sets], width, label=name)
        right.scatter(xs, [report["eval"][name][ps]["alpha"] for ps in sets], color="black", s=12, zorder=3)
    right.set_xticks(range(len(sets)), sets)
    s = report["sampler"]
    right.set_ylabel("alpha_on_target (bars), alpha (dots)")
    right.set_title(f"final drafts, T {s['temperature']}, top-p {s['top_p']}, K {s['k']}; c {report['c']:.3f}")
    right.legend()
    acceptance_by_position(third, report["eval"].get("best", {}))
    third.set_title("best draft: " + third.get_title())
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def acceptance_by_position(ax, acceptance: dict) -> None:
    """Acceptance at each draft position, given the position was reached, per prompt set, against alpha (dotted):
    the paper's i.i.d. assumption makes it flat, and tokens per call then follow from alpha alone."""
    for name, r in acceptance.items():
        pts = [(i + 1, a) for i, a in enumerate(r.get("acceptance_by_position") or []) if a is not None]
        if pts:
            line, = ax.plot(*zip(*pts), "o-", label=f"{name} (alpha {r['alpha']:.3f})")
            ax.axhline(r["alpha"], ls=":", color=line.get_color())
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("draft position i")
    ax.set_ylabel("P(token i accepted | reached)")
    ax.set_title("acceptance by position (dotted: alpha)")
    ax.set_ylim(0, 1)
    if ax.lines:
        ax.legend()
