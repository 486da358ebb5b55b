"""What `pip install draftsmith` takes and keeps. The base install holds what the sampler and the deploy path import;
the extras add what a user installs for (`train`, `deepspeed`, `engines`; `dev` for these tests). Every third-party
import of a layer is declared where that layer is installed; torch is a range, so the torch a machine already has (a
CUDA build) stays, which the resolver's own plan shows (`pip install --dry-run --report`, offline, in a throwaway
venv); these machines' CPU wheel comes from the install commands' constraints file. Training without the `train`
extra says which install is missing in one line."""

import ast
import functools
import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import ROOT
from packaging.requirements import Requirement

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own TOML reader
    import tomli as tomllib

# What each layer's users have installed: the sampler is the base install; the deploy path adds the engines'
# packages; the trainer its extras; the scripts and the tests run beside everything.
LAYERS = {"sampling": {"base"}, "deploy": {"base", "engines"}, "train": {"base", "train", "deepspeed"},
          "data": {"base", "engines"}, "drafts": {"base", "engines"},  # export and the benches read them: no trainer
          "engines": {"base", "engines"},  # the deploy check's engines: no trainer installed
          "scripts": {"base", "train", "deepspeed", "engines"},
          "tests": {"base", "train", "deepspeed", "engines", "dev"}}
# imports that run in another environment than draftsmith's
ELSEWHERE = {"vllm": "vLLM's own venv (draftsmith engines install vllm): engines/workers/vllm_judge.py "
                     "and vllm_corpus.py run there",
             "speculators": "vLLM's own venv, which installs it: engines/workers/eagle3_reference.py runs there",
             "specforge": "its wheel unpacked on PYTHONPATH in vLLM's venv, for eagle3_reference.py "
                          "(tests/test_peers.py)"}
# an import of a package its layer does not install, inside a function that only such an install reaches
LAZY = {("deploy/export.py", "wandb"): "log_bundle: only a run that logged to W&B, which the train extra trained",
        ("data/conversations.py", "datasets"): "a dataset folder, a hub id or a parquet file of conversations: a "
                                               "training corpus (the benches read ShareGPT's JSON)",
        ("data/corpus.py", "datasets"): "a corpus read from a dataset id or a data file: a training run's data",
        ("drafts/saved.py", "deepspeed"): "a ZeRO checkpoint consolidated: only a run trained with DeepSpeed has one",
        ("deploy/bench/peer_features.py", "datasets"): "speculators' prepared rows: it runs in speculators' own venv "
                                                       "(deploy/bench/peers.py), which installs datasets",
        ("scripts/gpu_image.py", "packaging"): "constraints(): the image copy, built by the dev tests (or by hand "
                                               "beside the dev extras) and on the GPU image, which has it"}
# declared, imported by no file of the repository
USED_WITHOUT_IMPORT = {"accelerate": "transformers dequantizes a GGUF target with it",
                       "hydra-optuna-sweeper": "a Hydra plugin: hparams_search=alpha_optuna"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def declared() -> dict[str, dict[str, Requirement]]:
    """{"base" or an extra: {distribution: requirement}}, an extra that names draftsmith's own extras expanded."""
    project = pyproject()
    groups = {"base": project["dependencies"], **project["optional-dependencies"]}
    out = {}

    def expand(group):
        reqs = {}
        for line in groups[group]:
            r = Requirement(line)
            if canonical(r.name) == "draftsmith":
                for extra in r.extras:
                    reqs.update(expand(extra))
            else:
                reqs[canonical(r.name)] = r
        return reqs

    for group in groups:
        out[group] = expand(group)
    return out


def local_modules() -> set[str]:
    return {p.stem for p in (ROOT / "tests").glob("*.py")} | {"tests", "draftsmith"}


def third_party_imports(path) -> set[str]:
    """The top-level modules a file imports (lazily too), less the standard library and draftsmith's own."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - local_modules()


@functools.cache
def installed_modules() -> dict[str, list[str]]:
    return md.packages_distributions()  # reads every installed distribution's file list: once


def distribution(module: str) -> str:
    """The distribution that provides a top-level module here (the module's own name where none is installed)."""
    return canonical(installed_modules().get(module, [module])[0])


def files_of(layer: str) -> list[Path]:
    """The layer's Python files, its subfolders' included, less those of a subfolder that is a layer of its own."""
    inner = [ROOT / other for other in LAYERS if other.startswith(f"{layer}/")]
    return sorted(f for f in (ROOT / layer).rglob("*.py") if not any(f.is_relative_to(d) for d in inner))


def undeclared(layer: str, files) -> list[str]:
    """The imports of `files` (in `layer`/) that no group the layer is installed with declares."""
    groups = declared()
    allowed = set().union(*(groups[g] for g in LAYERS[layer]))
    bad = []
    for f in files:
        rel = f.relative_to(ROOT).as_posix() if f.is_relative_to(ROOT) else f"{layer}/{f.name}"
        for module in sorted(third_party_imports(f)):
            dist = distribution(module)
            if module in ELSEWHERE or dist in allowed:
                continue
            if (rel, module) in LAZY and any(dist in reqs for reqs in groups.values()):
                continue
            where = [g for g in groups if dist in groups[g]]
            bad.append(f"{rel} imports {module} ({dist}): declared in {where or 'nothing'}, but {layer}/ is "
                       f"installed with {sorted(LAYERS[layer])}")
    return bad


def test_every_third_party_import_is_declared_where_its_layer_is_installed():
    bad = [b for layer in LAYERS for b in undeclared(layer, files_of(layer))]
    assert not bad, "\n".join(bad)


def test_every_declared_package_is_imported_or_says_why():
    imported = {distribution(m) for layer in LAYERS for f in files_of(layer)
                for m in third_party_imports(f)}
    unused = {d for reqs in declared().values() for d in reqs} - imported - set(USED_WITHOUT_IMPORT)
    assert not unused, f"declared in pyproject.toml, imported nowhere: {sorted(unused)}"


def test_the_import_check_sees_an_undeclared_import(tmp_path):
    """The check can fail: the trainer's Lightning, imported by a sampler module, is in no list the sampler has."""
    f = tmp_path / "planted.py"
    f.write_text("def f():\n    import lightning\n")
    assert undeclared("sampling", [f]) == ["sampling/planted.py imports lightning (lightning): declared in ['train', "
                                           "'dev'], but sampling/ is installed with ['base']"]


def test_the_trainer_checks_for_packages_of_the_train_extra():
    import draftsmith.train

    core = set(draftsmith.train.TRAIN_CORE.values())
    assert core <= set(declared()["train"]) and "lightning" in core and "hydra-core" in core
    assert {distribution(m) for m in draftsmith.train.TRAIN_CORE} == core


def blocking(tmp_path, *modules) -> dict:
    """An environment in which `modules` are not installed, as Python sees it (a sitecustomize marks them absent)."""
    (tmp_path / "sitecustomize.py").write_text(f"import sys\nsys.modules.update(dict.fromkeys({modules!r}))\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}


def test_training_without_the_train_extra_says_which_install_in_one_line(tmp_path):
    """The README's training command where Lightning and Hydra are not installed: one line with the install that
    fixes it, exit 1; importing the trainer raises an ImportError with the same line."""
    env = blocking(tmp_path, "lightning", "hydra")
    res = subprocess.run([sys.executable, "train/draft.py", "recipe=smoke", f"hydra.run.dir={tmp_path / 'run'}"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 1, res.stderr[-2000:]
    assert res.stderr.strip().count("\n") == 0, res.stderr[-2000:]
    assert 'pip install "draftsmith[train]"' in res.stderr and "lightning, hydra-core" in res.stderr, res.stderr
    imported = subprocess.run([sys.executable, "-c", "import draftsmith.train.draft"], env=env, capture_output=True,
                              text=True, timeout=120)
    assert imported.returncode == 1
    assert 'draftsmith\'s trainer needs the `train` extra (lightning, hydra-core not installed): pip ' \
           'install "draftsmith[train]"' in imported.stderr, imported.stderr[-2000:]
    assert not (tmp_path / "run").exists()
    # the deploy path, which reads a run's saved drafts and draws its pictures, needs no trainer
    deploy = subprocess.run([sys.executable, "-c", "import draftsmith.deploy.export, draftsmith.deploy.conformance"],
                            env=env, capture_output=True, text=True, timeout=300)
    assert deploy.returncode == 0, deploy.stderr[-2000:]


def test_the_trainer_imports_without_wandb_and_datasets(tmp_path):
    """A run with logger=csv on the stdlib corpus needs neither (the GPU machine has no W&B): no refusal at import."""
    res = subprocess.run([sys.executable, "-c", "import draftsmith.train.draft"], env=blocking(tmp_path, "wandb",
                         "datasets"), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]


def readme_commands() -> list[str]:
    """The README's first two commands: set up and train, set up and test."""
    return re.findall(r"```bash\n(python3 -m venv .*)\n```", (ROOT / "README.md").read_text())[:2]


def test_the_install_commands_take_the_cpu_wheel_from_the_constraints_file():
    """The README's two commands and CI install with constraints/cpu.txt, whose torch the range admits: the package
    itself pins no wheel."""
    pins = [Requirement(line) for line in (ROOT / "constraints" / "cpu.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    (torch_pin,) = [r for r in pins if r.name == "torch"]
    (pinned,) = [s.version for s in torch_pin.specifier if s.operator == "=="]
    torch_range = declared()["base"]["torch"].specifier
    assert torch_range.contains(pinned) and pinned.endswith("+cpu"), (torch_range, pinned)
    train, test = readme_commands()
    assert "-c constraints/cpu.txt" in train and '".[train]"' in train and "python train/draft.py" in train, train
    install = re.search(r"pip install [^&]*", test).group(0).strip()
    assert "-c constraints/cpu.txt" in install and '".[dev]"' in install, test
    assert install in (ROOT / ".ci" / "run").read_text(), f"CI does not run the README's install: {install}"


# --- what pip plans for a venv that already holds another torch --------------------------------------------------


@pytest.fixture(scope="module")
def offline_index(tmp_path_factory):
    """A find-links folder with this checkout's wheel and a stand-in torch 2.13.0 wheel (metadata only: what the
    resolver would take if it wanted a torch), and the metadata of every distribution installed here but torch and
    draftsmith, for a venv to hold: whatever draftsmith needs is there, so the plan shows only what would change."""
    root = tmp_path_factory.mktemp("index")
    wheels = root / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels),
                    str(ROOT)], check=True, capture_output=True, text=True)
    with zipfile.ZipFile(wheels / "torch-2.13.0-py3-none-any.whl", "w") as z:
        z.writestr("torch-2.13.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: torch\nVersion: 2.13.0\n")
        z.writestr("torch-2.13.0.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                   "Tag: py3-none-any\n")
        z.writestr("torch-2.13.0.dist-info/RECORD", "")
    metadata = {}
    for d in md.distributions():
        name = canonical(d.metadata["Name"])
        if name not in metadata and name not in ("torch", "draftsmith"):
            metadata[name] = (d.version, d.read_text("METADATA") or d.read_text("PKG-INFO"))
    return wheels, metadata


def planned_installs(tmp_path, offline_index, torch_version: str, spec: str) -> dict[str, str]:
    """{name: version} that `pip install SPEC` would install into a venv holding torch `torch_version` and all else
    draftsmith needs, as pip's own report says; no index, nothing downloaded, nothing installed."""
    wheels, metadata = offline_index
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    held = {**metadata, "torch": (torch_version, f"Metadata-Version: 2.1\nName: torch\nVersion: {torch_version}\n")}
    for name, (version, text) in held.items():
        info = venv / site.split(str(venv) + os.sep, 1)[1] / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(text)
    # this machine's pip configuration (find-links, indexes, constraints) stays out: the plan is the package's alone
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")} | {"PIP_CONFIG_FILE": os.devnull}
    report = tmp_path / "report.json"
    res = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--dry-run", "--quiet",
                          "--report", str(report), "--no-index", "--find-links", str(wheels), spec],
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    installs = json.loads(report.read_text())["install"]
    return {canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in installs}


@pytest.mark.parametrize("held", ["2.7.0", "2.11.0"])
def test_pip_install_keeps_a_torch_the_range_admits(tmp_path, offline_index, held):
    """The range's floor and the GPU machine's torch 2.11 stay: pip plans draftsmith with the trainer and ZeRO, and
    no torch (with the old exact pin it planned torch 2.13.0 over them)."""
    plan = planned_installs(tmp_path, offline_index, held, "draftsmith[train,deepspeed]")
    assert "draftsmith" in plan and "torch" not in plan, plan
    assert declared()["base"]["torch"].specifier.contains(held)


def test_pip_install_replaces_a_torch_below_the_floor(tmp_path, offline_index):
    """The check sees a torch in the plan: below the range's floor (2.7), pip plans the one it finds."""
    plan = planned_installs(tmp_path, offline_index, "2.6.0", "draftsmith")
    assert plan.get("torch") == "2.13.0", plan


def test_a_script_run_by_path_finds_the_packages_it_imports_not_its_neighbours():
    """Python puts a script's own folder first on its path: vLLM's workers, run by path in vLLM's venv, once sat
    beside engines/vllm.py and imported it for vLLM. No file or folder beside a worker may be named like a
    package it imports."""
    workers = ROOT / "engines" / "workers"
    scripts = sorted(workers.glob("vllm_*.py"))
    assert {s.stem for s in scripts} == {"vllm_corpus", "vllm_judge", "vllm_eagle3_logits"}
    for script in scripts:
        neighbours = {p.stem for p in script.parent.iterdir() if p != script}
        clashes = third_party_imports(script) & neighbours
        assert "vllm" in third_party_imports(script) and not clashes, (script, clashes)
