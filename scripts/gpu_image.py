"""The GPU machine's image copied on this machine, and the wheels that image lacks (scripts/fetch_gpu_wheels.sh).

    python3 scripts/gpu_image.py venv DIR       # a venv holding scripts/gpu_image.txt and nothing else (reused)
    python3 scripts/gpu_image.py carried DIR    # what draftsmith needs there that the image lacks, by pip's resolver

The copy differs from the image where this machine cannot follow it: GPU_IMAGE_PYTHON (default python3.11) stands in
for its Python 3.12, torch 2.13.0+cpu for its CUDA torch (the CPU build here is for 3.11 only), numpy 2.4.6 for its
2.5.2 (which needs 3.12); triton and the CUDA libraries (nvidia-*, cuda-*) are left out. `carried` prints one line a
package, `wheel NAME==VERSION` (published as a wheel) or `source NAME==VERSION` (published as source only: to build).
The resolver keeps every image package at the image's version unless draftsmith's own requirements exclude that
version (transformers 5.17.0 against >=5.24): those, and what they need, are what the image lacks. Needs `packaging`
beside the standard library (the dev extras and the image have it).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IMAGE = ROOT / "scripts" / "gpu_image.txt"
STAND_INS = {"torch": "torch==2.13.0+cpu", "triton": None,  # None: left out of the copy
             "numpy": "numpy==2.4.6"}  # the newest numpy for the copy's Python 3.11
CUDA_ONLY = ("nvidia-", "cuda-")  # a real freeze's CUDA libraries (GBs): only its CUDA torch loads them
# extras of draftsmith the GPU check runs with, and what it leaves out of them: it logs to CSV (no W&B) and sweeps
# nothing (no Optuna)
EXTRAS = ("train", "deepspeed")
LEFT_OUT = {"wandb", "hydra-optuna-sweeper"}


def _name(req: str) -> str:
    """The normalised project name at the start of a requirement string."""
    head = req.split(";")[0].strip()
    for sep in "<>=!~[ (":
        head = head.split(sep)[0]
    return head.strip().lower().replace("_", "-").replace(".", "-")


def image_lines() -> list[str]:
    return [ln.strip() for ln in IMAGE.read_text().splitlines() if ln.strip() and not ln.startswith("#")]


def copy_lines() -> list[str]:
    out = []
    for ln in image_lines():
        name = _name(ln)
        if name.startswith(CUDA_ONLY):
            continue
        if name in STAND_INS:
            if STAND_INS[name]:
                out.append(STAND_INS[name])
        else:
            out.append(ln)
    return out


def roots() -> list[str]:
    """draftsmith's requirements (base and EXTRAS) from pyproject.toml, less LEFT_OUT."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in EXTRAS:
        reqs += project["optional-dependencies"][extra]
    return [r for r in reqs if _name(r) not in LEFT_OUT and not r.startswith("draftsmith")]


def constraints() -> list[str]:
    """The image's pins that draftsmith's requirements admit: the resolver may move nothing else."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    spec = {}
    for r in roots():
        req = Requirement(r)
        spec.setdefault(_name(r), []).append(req.specifier)
    out = []
    for ln in copy_lines():
        name, _, version = ln.partition("==")
        if version and all(Version(version) in s for s in spec.get(_name(name), [])):
            out.append(ln)
    return out


def build_venv(venv: Path) -> None:
    """The copy's venv, made once per content of gpu_image.txt (a stamp in the venv says which)."""
    stamp = hashlib.sha256("\n".join(copy_lines()).encode()).hexdigest()[:16]
    if (venv / "gpu_image.stamp").is_file() and (venv / "gpu_image.stamp").read_text() == stamp:
        return
    python = os.environ.get("GPU_IMAGE_PYTHON", "python3.11")
    subprocess.run([python, "-m", "venv", "--clear", str(venv)], check=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n".join(copy_lines()) + "\n")
    try:  # --no-deps: the venv holds the list and nothing pip would add, so nothing missing from the image hides
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "-r", f.name],
                       check=True)
    finally:
        os.unlink(f.name)
    (venv / "gpu_image.stamp").write_text(stamp)


def carried(venv: Path) -> list[str]:
    """pip's resolver in the copy: what installing draftsmith's needs there would add or change."""
    with tempfile.TemporaryDirectory() as tmp:
        report, pins = Path(tmp) / "report.json", Path(tmp) / "image.txt"
        pins.write_text("\n".join(constraints()) + "\n")
        res = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--dry-run", "-c", str(pins),
                              "--report", str(report), *roots()], capture_output=True, text=True)
        if res.returncode != 0:
            sys.exit(f"gpu_image: draftsmith's requirements do not resolve against scripts/gpu_image.txt: "
                     f"{' '.join(res.stderr.split())[-600:]}")
        items = json.loads(report.read_text())["install"]
    out = []
    for it in items:
        meta, url = it["metadata"], it["download_info"]["url"]
        kind = "wheel" if url.endswith(".whl") else "source"
        out.append(f"{kind} {meta['name']}=={meta['version']}")
    return sorted(out, key=str.lower)


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("venv", "carried"):
        sys.exit(__doc__.strip().splitlines()[2].strip() + "\n" + __doc__.strip().splitlines()[3].strip())
    venv = Path(argv[1]).absolute()
    if argv[0] == "venv":
        build_venv(venv)
    else:
        if not (venv / "bin" / "python").is_file():
            sys.exit(f"gpu_image: no venv at {venv}: make it first with python3 scripts/gpu_image.py venv {venv}")
        print("\n".join(carried(venv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
