"""A bundle on disk: a draft, its target (copied or referenced), the card (`speculative.json`, `README.md`) and
every other file's sha256, so an engine is never judged on a bundle edited after export.

    DIR/{draft/, target.json or target/, speculative.json, vllm_speculative_config.json, README.md}
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from draftsmith.deploy.plots import DEPLOYMENT_PLOT, deployment_plot
from draftsmith.sampling.errors import DraftsmithError
from draftsmith.sampling.machine import files_sha256, stream_into, write_text

# the card: deploy_check itself adds its results there
UNCHECKED = ("speculative.json", "README.md", "acceptance.png", "deployment.png")


def sha256(path: Path) -> str:
    """One file's digest: what the card records for each file of the bundle."""
    return stream_into(hashlib.sha256(), path).hexdigest()


def bundle_hashes(folder: Path) -> dict[str, str]:
    """{relative path: sha256} of every file of a bundle but its card."""
    return {p.relative_to(folder).as_posix(): sha256(p) for p in sorted(folder.rglob("*"))
            if p.is_file() and p.relative_to(folder).as_posix() not in UNCHECKED}


@dataclass
class Bundle:
    path: Path
    spec: dict
    target_dir: Path
    draft_dir: Path


def open_bundle(path, target: str | None = None) -> Bundle:
    """A bundle as `draftsmith export` wrote it, wherever it was copied; refused, naming the file, when one is
    missing or was edited. Its target: the copy inside it, else `target` (the card's TARGET), else
    the name it was exported with, resolved here (an alias, a hub id, a folder)."""
    path = Path(path)
    card = path / "speculative.json"
    if not card.is_file():
        raise DraftsmithError(f"{path} is not a bundle ({card.name} missing): make one with draftsmith export")
    try:
        spec = json.loads(card.read_text())
    except ValueError as e:
        raise DraftsmithError(f"{card} is not valid JSON ({e}): export the bundle again") from None
    files = spec.get("files")
    if not files:
        raise DraftsmithError(f"{path} predates file hashes in bundles: export it again with draftsmith export")
    for rel, digest in files.items():
        f = path / rel
        if not f.is_file():
            raise DraftsmithError(f"{path}: {rel} is missing; the bundle is incomplete, export it again")
        if sha256(f) != digest:
            raise DraftsmithError(f"{path}: {rel} changed after export (sha256 differs from the card); export again")
    ref = json.loads((path / "target.json").read_text())
    target_dir = _target_dir(path, ref, target)
    if files_sha256(target_dir, ["config.json"]) != ref["config_sha256"]:
        raise DraftsmithError(f"the target at {target_dir} is not the one exported with this bundle (config.json "
                              "differs); export the bundle again")
    return Bundle(path, spec, target_dir, path / "draft")


def _target_dir(path: Path, ref: dict, given: str | None) -> Path:
    from draftsmith.sampling.names import resolve

    if ref.get("path") == "target":
        target_dir = path / "target"
    elif given or not ref.get("path"):
        name = given or ref["name"]
        try:
            target_dir = resolve(name)
        except (ValueError, OSError) as e:
            raise DraftsmithError(f"the bundle's target {name!r} is not here ({e}): pass its folder as --target "
                                  "(the card's TARGET), or export with --copy-target") from None
    else:  # bundles exported before bundles travelled name the exporting host's folder
        target_dir = Path(ref["path"])
    if not (target_dir / "config.json").is_file():
        raise DraftsmithError(f"the bundle's target {target_dir} is missing (target.json); pass its folder as --target "
                              "(the card's TARGET), or re-export with --copy-target")
    return target_dir


# -- the card ---------------------------------------------------------------------------------------------------
def write_card(bundle: Bundle, report: dict) -> None:
    """Record the engine's results in speculative.json (`deployment`) and as a table in README.md."""
    card = bundle.path / "speculative.json"
    spec = json.loads(card.read_text())
    spec.setdefault("deployment", {})[report["engine"]] = report
    write_text(card, json.dumps(spec, indent=2))
    readme = bundle.path / "README.md"
    text = readme.read_text() if readme.is_file() else ""
    marker = "\n## Deployment checks\n"
    text = text.split(marker)[0].rstrip("\n") + "\n" + marker + deployment_table(spec["deployment"])
    write_text(readme, text)
    deployment_plot(spec["deployment"], bundle.path / DEPLOYMENT_PLOT)


def deployment_table(deployment: dict) -> str:
    lines = ["", "Lossless speculative decoding, judged by `draftsmith deploy-check` (draftsmith's tests).", "",
             "| engine | version | setting | verdict | tokens/s plain | tokens/s speculative | speed-up | "
             "acceptance (engine's count) |", "|---|---|---|---|---|---|---|---|"]
    for name, rep in deployment.items():
        for setting, r in rep["settings"].items():
            acc = "" if r.get("engine_acceptance") is None else f"{r['engine_acceptance']:.3f}"
            lines.append(f"| {name} | {rep['version']} | {setting} | {r['verdict']} | {r['tok_s_plain']:.1f} | "
                         f"{r['tok_s_speculative']:.1f} | {r['speedup']:.2f}x | {acc} |")
            for label, v in r.get("variants", {}).items():  # timed beside, not judged
                acc = "" if v.get("engine_acceptance") is None else f"{v['engine_acceptance']:.3f}"
                lines.append(f"| {name}, {label} | {rep['version']} | {setting} | (speed only) | "
                             f"{r['tok_s_plain']:.1f} | {v['tok_s_speculative']:.1f} | {v['speedup']:.2f}x | {acc} |")
    cpu = next(iter(deployment.values()))["machine"].get("cpu", "")
    return ("\n".join(lines) + f"\n\n![speed-up and verdict per engine]({DEPLOYMENT_PLOT})\n\n"
            f"Measured on: {cpu}; details in speculative.json, `deployment`.\n")
