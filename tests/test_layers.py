"""The package's floors hold: sampling < engines < data < drafts < train, deploy < scripts. A lower floor never
imports a higher one, and the two top floors never import each other: the tool that ships a draft does not reach
into the one that trains it (export reads a run's checkpoint through `drafts`), and the trainer does not reach into
shipping. No module imports itself back through others. Every import counts, a lazy one inside a function too."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = {"sampling": 0, "engines": 1, "data": 2, "drafts": 3, "train": 4, "deploy": 4, "scripts": 5}


def modules() -> dict[str, Path]:
    out = {}
    for layer in LAYERS:
        for f in sorted((ROOT / layer).rglob("*.py")):
            parts = [layer, *f.relative_to(ROOT / layer).with_suffix("").parts]
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def imports(path: Path) -> set[str]:
    """The draftsmith modules a file imports, as 'layer.module' (or 'layer' for the package itself)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for n in names:
            parts = n.split(".")
            if parts[0] == "draftsmith" and len(parts) > 1 and parts[1] in LAYERS:
                found.update(".".join(parts[1:k]) for k in range(2, len(parts) + 1))  # the module, or a package
            elif parts[0] in LAYERS and len(parts) > 1:  # the old top-level names must not come back
                found.add("OLD:" + n)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: {i for i in imports(f) if (i in mods and i != m) or i.startswith("OLD:")} for m, f in mods.items()}


def violations(g: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, deps in g.items():
        for dep in deps:
            here, there = mod.split(".")[0], dep.split(".")[0]
            if dep.startswith("OLD:"):
                bad.append(f"{mod} imports {dep[4:]} (the package is draftsmith.*)")
            elif LAYERS[there] > LAYERS[here] or (LAYERS[there] == LAYERS[here] and there != here):
                bad.append(f"{mod} imports {dep}")
    return sorted(bad)


def test_no_module_imports_a_higher_layer_or_an_old_top_level_name():
    bad = violations(graph())
    assert not bad, ("upward or sideways imports (sampling < engines < data < drafts < train, deploy < scripts):\n"
                     + "\n".join(bad))


def test_no_import_cycles():
    g = graph()
    cycles, state = [], {}

    def visit(m, path):
        state[m] = "open"
        for d in sorted(g.get(m, ())):
            if d.startswith("OLD:") or d == m.split(".")[0]:  # a package's __init__ re-exports its own modules
                continue
            if state.get(d) == "open":
                cycles.append(" -> ".join(path[path.index(d):] + [d]))
            elif d not in state:
                visit(d, path + [d])
        state[m] = "done"

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_check_sees_an_upward_import(tmp_path):
    """The rule can fail: a planted `from draftsmith.train...` in a sampler module is an upward import."""
    f = tmp_path / "planted.py"
    f.write_text("def f():\n    from draftsmith.train.module import DraftModule\n")
    assert {"train", "train.module"} <= imports(f)  # the package and its module (and the name, not a module)
    # and the rule flags an upward import, a sideways one between the top floors, and not a downward one
    planted = {"sampling.load": {"train.module"}, "deploy.export": {"train.report"}, "train.draft": {"deploy.cli"},
               "data.corpus": {"drafts.build"}, "drafts.evaluate": {"data.chat"}, "train.module": {"drafts.batch"}}
    assert violations(planted) == ["data.corpus imports drafts.build", "deploy.export imports train.report",
                                   "sampling.load imports train.module", "train.draft imports deploy.cli"]


TRAINER = ("lightning", "pytorch_lightning", "hydra", "omegaconf", "wandb", "datasets", "deepspeed")


def test_the_deploy_path_loads_no_trainer():
    """Generating, exporting a finished run and judging engines (and the command that runs them) import none of the
    trainer's packages: a fresh interpreter imports each and lists what came in. (Importing conformance pulled in
    Lightning and Hydra through the card's plot and the train package's schema registration: 4.8 s.)"""
    import subprocess
    import sys

    code = ("import sys, importlib; [importlib.import_module(m) for m in sys.argv[1:]]; "
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({TRAINER!r})))")
    deploy_path = ["draftsmith.deploy.cli", "draftsmith.sampling.generate", "draftsmith.deploy.export",
                   "draftsmith.deploy.conformance", "draftsmith.engines.vllm",
                   "draftsmith.engines.llamacpp", "draftsmith.deploy.bundle", "draftsmith.deploy.bench.serve"]
    res = subprocess.run([sys.executable, "-c", code, *deploy_path], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "[]", res.stdout
    # and the check sees it when a module does load one
    res = subprocess.run([sys.executable, "-c", code, "draftsmith.train.module"], capture_output=True, text=True,
                         timeout=300)
    assert "lightning" in res.stdout
