"""What the command line's verbs share: the examples in their help, and what a `--draft` path names.

A verb that runs a draft takes what the verb before it made: a bundle (`draftsmith export`: its draft, its target,
the K it recommends and the settings it was measured at), a run directory (`draftsmith train`: its best draft and
the target it was trained for), or a draft checkpoint directory itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.sampling.errors import DraftsmithError


def examples(doc: str) -> str:
    """The indented usage lines of a module's docstring, as the `examples:` part of its --help."""
    lines = [line.strip() for line in doc.splitlines() if line.startswith("    ") and line.strip()]
    return "examples:\n" + "\n".join(f"  {line}" for line in lines) if lines else ""


@dataclass(frozen=True)
class Draft:
    """A draft to run, and what its source says about how (None: it does not say)."""

    path: str  # the draft's checkpoint directory
    target: str | None = None  # the target it was trained or exported for
    k: int | None = None  # a bundle's recommended K
    sampling: dict = field(default_factory=dict)  # temperature, top_p, top_k it was measured at
    alpha: float | None = None  # a bundle's measured acceptance
    source: str = "checkpoint"  # bundle | run | checkpoint


def engine_k(spec: dict, engine: str) -> int:
    """The K a bundle gives an engine: the fastest measured in it (`export --engines`, also written into its
    config), else the bundle's recommended K."""
    return int((spec.get("engine_k") or {}).get(engine, {}).get("best_k", spec["recommended_k"]))


def locate_draft(path: str) -> Draft:
    """A bundle, a run directory or a draft checkpoint, as a `Draft`; anything else is left to the model loader,
    which names what is wrong with it."""
    p = Path(path).expanduser()
    if (p / "speculative.json").is_file() and (p / "draft").is_dir():
        spec, ref = (_json(p / name) for name in ("speculative.json", "target.json"))
        # the copy inside the bundle, else the name it was exported with (bundles before they travelled: a folder)
        target = str(p / "target") if ref.get("path") == "target" else ref.get("path") or ref.get("name")
        return Draft(str(p / "draft"), target, engine_k(spec, "draftsmith"), spec.get("sampling") or {},
                     spec.get("alpha"), "bundle")
    if (p / "best_draft").is_dir():
        cfg = _run_config(p)
        sampler = cfg.get("sampler") or {}
        return Draft(str(p / "best_draft"), (cfg.get("target") or {}).get("name"), None,
                     {k: sampler[k] for k in ("temperature", "top_p", "top_k") if k in sampler}, None, "run")
    return Draft(str(p))


def draft_label(path: str, taken) -> str:
    """A short unique name: the run directory's name for a run's best_draft (or a bundle's draft/), else the
    directory's."""
    p = Path(path)
    name = p.parent.name if p.name in ("best_draft", "draft") else p.name
    return name if name not in taken else f"{name}#{len(taken)}"


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DraftsmithError(f"{path} is not readable JSON ({type(e).__name__}): export the bundle again") from None


def _run_config(run: Path) -> dict:
    """The run's resolved config as Hydra saved it (`.hydra/config.yaml`), or {}."""
    import yaml

    f = run / ".hydra" / "config.yaml"
    try:
        return yaml.safe_load(f.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}


# One meaning per flag across the verbs (issue 52): the artifact is the positional (`--draft` kept as an alias),
# `-k` is K, `--top-k` the top-k of a distribution, `--prompts` names prompt sets or files, `--n-prompts` counts them,
# and `--dtype` takes DTYPE_CHOICES (sampling/load.py) everywhere.
ARTIFACT_HELP = "a bundle (draftsmith export), a run directory or a draft checkpoint"


def add_artifact(ap, help: str = ARTIFACT_HELP, many: bool = False) -> None:
    """The artifact a verb reads, as its positional; `--draft` names it too (the older spelling)."""
    ap.add_argument("artifact", nargs="*" if many else "?", metavar="ARTIFACT", help=help)
    ap.add_argument("--draft", dest="draft_alias", nargs="+" if many else None, metavar="ARTIFACT",
                    help="the same, as an option (an alias of the positional)")


def artifact_of(args, required: bool = False):
    """The artifact(s) the command line gave, by position or by --draft, never both."""
    given, alias = args.artifact, args.draft_alias
    if given and alias:
        raise DraftsmithError("give the artifact once: as the positional or with --draft, not both")
    value = given or alias or None
    if required and not value:
        raise DraftsmithError(f"no artifact: pass {ARTIFACT_HELP}, as the first argument")
    return value


def target_of(given: str | None, source: Draft | None) -> str:
    """The target: the command line's, else the one the artifact names (a bundle's, a run's). Never the demo target
    by default: a draft runs against the target it was trained for, and only its user knows which that is."""
    if given:
        return given
    if source is not None and source.target:
        return source.target
    what = f"{source.path} names none" if source is not None else "no bundle or run names one"
    raise DraftsmithError(f"no target: {what}; pass --target NAME (a hub id, a checkpoint directory, a .gguf, or "
                          "smollm2-135m for the demo)")
