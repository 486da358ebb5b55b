"""The GPU check's bookkeeping (scripts/gpu_check.sh), standard library only: it runs under the image's Python.

    python3 scripts/gpu_check_summary.py record SUMMARY STEP PART RC SECONDS [STAND_IN [STATUS]]  # rows on stdin
    python3 scripts/gpu_check_summary.py done SUMMARY STEP           # exit 0 if STEP passed in an earlier run
    python3 scripts/gpu_check_summary.py wheel-matches WHEEL         # exit 1 if a draftsmith wheel is not this tree
    python3 scripts/gpu_check_summary.py visits RUN_DIR              # tokens/s on first visits and on revisits

SUMMARY (summary.json in the check's output folder) holds every step's outcome and figure rows; a step passes when
its command exits 0 and its log holds at least one figure row. Its status: ok or failed by that rule, or as the check
says: timeout (stopped at its limit), no time (not started: the deadline was too near), running (recorded as it
starts: an entry left so, the command was killed from outside while the step ran).
"""

from __future__ import annotations

import csv
import json
import os
import statistics
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {"steps": {}}


STATUSES = ("timeout", "no time", "running")  # what the check may say instead of ok or failed


def record(path: Path, step: str, part: str, rc: int, seconds: int, stand_in: str, rows: list[str],
           status: str = "") -> bool:
    summary = _load(path)
    ok = not status and rc == 0 and bool(rows)
    summary["steps"][step] = {"part": part, "ok": ok, "status": status or ("ok" if ok else "failed"), "rc": rc,
                              "seconds": seconds, "rows": rows, **({"stand_in": stand_in} if stand_in else {})}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".summary.")
    with os.fdopen(fd, "w") as f:
        json.dump(summary, f, indent=1)
    os.replace(tmp, path)  # a machine taken back mid-write leaves the previous summary whole
    return ok


def done(path: Path, step: str) -> bool:
    return bool(_load(path)["steps"].get(step, {}).get("ok"))


def _package_dirs() -> dict[str, str]:
    """{'draftsmith/sampling/': 'sampling/', ...} from pyproject.toml's package-dir table (read without tomllib,
    which Python 3.10 lacks: the table is one `"draftsmith.X" = "DIR"` a line)."""
    text = (ROOT / "pyproject.toml").read_text().split("[tool.setuptools.package-dir]", 1)[1].split("\n[", 1)[0]
    out = {}
    for line in text.splitlines():
        if "=" in line and line.strip().startswith('"'):
            pkg, folder = (s.strip().strip('"') for s in line.split("=", 1))
            out[pkg.replace(".", "/") + "/"] = folder + "/"
    return out


def wheel_mismatch(wheel: Path) -> str | None:
    """The first file in which a draftsmith wheel and this working tree differ, or None."""
    dirs = _package_dirs()
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for name in sorted(names):
            prefix = next((p for p in sorted(dirs, key=len, reverse=True) if name.startswith(p)), None)
            if prefix is None:
                continue
            tree = ROOT / (dirs[prefix] + name[len(prefix):])
            if not tree.is_file():
                return f"{name} (not in the tree)"
            if tree.read_bytes() != z.read(name):
                return str(tree.relative_to(ROOT))
    for prefix, folder in dirs.items():
        for f in (ROOT / folder).glob("*.py"):
            if prefix + f.name not in names:
                return f"{f.relative_to(ROOT)} (not in the wheel)"
    return None


def visits(run_dir: Path) -> list[str]:
    """Median train/tokens_per_s of the steps of the first epoch (each block's first visit: the target's pass) and
    of later epochs (revisits: the kept logits), from the run's CSV log."""
    files = sorted(run_dir.glob("**/metrics.csv"))
    if not files:
        return []
    by_epoch: dict[int, list[float]] = {}
    with open(files[-1]) as f:
        for row in csv.DictReader(f):
            if row.get("train/tokens_per_s") and row.get("epoch"):
                by_epoch.setdefault(int(float(row["epoch"])), []).append(float(row["train/tokens_per_s"]))
    first = by_epoch.get(0, [])
    later = [v for e, vs in by_epoch.items() if e > 0 for v in vs]
    rows = []
    if first:
        rows.append(f"tokens/s on first visits (epoch 1, teacher pass): median {statistics.median(first):.0f} "
                    f"over {len(first)} steps")
    if later:
        rows.append(f"tokens/s on revisits (epochs 2+, kept logits): median {statistics.median(later):.0f} "
                    f"over {len(later)} steps")
    return rows


def main(argv: list[str]) -> int:
    cmd, *args = argv or [""]
    if cmd == "record" and len(args) in (5, 6, 7) and (len(args) < 7 or args[6] in STATUSES):
        rows = [ln.rstrip() for ln in sys.stdin if ln.strip()]
        stand_in, status = (args[5:] + ["", ""])[:2]
        return 0 if record(Path(args[0]), args[1], args[2], int(args[3]), int(args[4]), stand_in, rows,
                           status) else 1
    if cmd == "done" and len(args) == 2:
        return 0 if done(Path(args[0]), args[1]) else 1
    if cmd == "wheel-matches" and len(args) == 1:
        diff = wheel_mismatch(Path(args[0]))
        if diff:
            print(f"gpu_check: {Path(args[0]).name} was built from another tree ({diff} differs): run "
                  "bash scripts/fetch_gpu_wheels.sh again", file=sys.stderr)
            return 1
        return 0
    if cmd == "visits" and len(args) == 1:
        rows = visits(Path(args[0]))
        print("\n".join(rows) if rows else f"no train/tokens_per_s rows in {args[0]}")
        return 0 if rows else 1
    print(__doc__.split("\n\n")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
