"""`draftsmith recipes`: the recipes there are, one line each, and a recipe's file as shipped (torchtune's `tune ls`
and `tune cp`); the text `draftsmith train --help` shows. Reads the YAML files as text: no Hydra, nothing heavy.

    draftsmith recipes                      # every recipe, one line each, and the config groups' choices
    draftsmith recipes gpu_8b               # its file, as shipped
    draftsmith recipes gpu_8b --copy my.yaml   # a copy to edit, used with --config-dir (see the printed line)
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

# beside this package in the checkout and in the installed wheel alike (train/draft.py's RECIPES)
ROOT = Path(__file__).resolve().parent.parent / "recipes"
NOT_GROUPS = ("recipe", "prompts", "shapes")  # folders of recipes/ that are no config group
SUMMARY = "# summary: "


def summaries() -> dict[str, str]:
    """recipe name: its one line (the file's `# summary:` comment)."""
    out = {}
    for path in sorted((ROOT / "recipe").glob("*.yaml")):
        line = next((ln for ln in path.read_text().splitlines() if ln.startswith(SUMMARY)), SUMMARY + "?")
        out[path.stem] = line[len(SUMMARY):]
    return out


def groups() -> dict[str, list[str]]:
    """config group: its choices (recipes/GROUP/*.yaml)."""
    return {d.name: sorted(p.stem for p in d.glob("*.yaml"))
            for d in sorted(ROOT.iterdir()) if d.is_dir() and d.name not in NOT_GROUPS and not d.name.startswith("_")}


def overview() -> str:
    width = max(map(len, summaries()))
    lines = ["recipes (recipe=NAME; `draftsmith recipes NAME` shows its file):"]
    lines += [f"  {name:<{width}}  {text}" for name, text in summaries().items()]
    lines += ["", "config groups (GROUP=CHOICE; each recipe picks some, the command line wins):"]
    lines += [f"  {g:<15}{', '.join(c)}" for g, c in groups().items()]
    return "\n".join(lines)


def main(argv=None, prog=None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description="the recipes there are, or one recipe's file",
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="examples:\n  draftsmith recipes\n  draftsmith recipes gpu_8b\n"
                                        "  draftsmith recipes gpu_8b --copy my_recipes/recipe/mine.yaml\n"
                                        "  draftsmith train recipe=gpu_8b target.name=ORG/MODEL --cfg job"
                                        "   # the whole composed config")
    ap.add_argument("name", nargs="?", help="a recipe: print its file")
    ap.add_argument("--copy", type=Path, metavar="PATH", help="write the recipe's file there, to edit")
    args = ap.parse_args(argv)
    if args.name is None:
        print(overview())
        return 0
    path = ROOT / "recipe" / f"{args.name}.yaml"
    if not path.is_file():
        ap.exit(2, f"error: no recipe {args.name!r}: choose one of {', '.join(summaries())}\n")
    if args.copy is None:
        print(f"# {path}\n{path.read_text()}", end="")
        return 0
    args.copy.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(path, args.copy)
    where = args.copy.resolve()
    hint = (f"draftsmith train --config-dir {where.parent.parent} recipe={where.stem}" if where.parent.name == "recipe"
            else f"move it to DIR/recipe/{where.name}, then: draftsmith train --config-dir DIR recipe={where.stem}")
    print(f"wrote {args.copy}; train with it: {hint}")
    return 0
