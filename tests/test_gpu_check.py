"""The GPU check as far as a CPU machine can take it: it refuses here in one line unless asked for its CPU dry run;
the dry run runs its steps as the GPU machine would (commands under `timeout`, figure rows in summary.json, big
files in a scratch folder, a rerun skipping what passed unless what later steps read from it is gone); a step
stopped by the deadline leaves its log and its entry; a stale draftsmith wheel is refused; and in a copy of the GPU
machine's image, with the wheels the resolver chose for it, every carried package imports and the whole dry run
passes."""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20


def run_check(out: Path, scratch: Path, steps: str | None = None, timeout: int = 600, shared_home: bool = True,
              **env) -> subprocess.CompletedProcess:
    """`GPU_CHECK_DEVICE=cpu bash scripts/gpu_check.sh OUT` (the models cache shared with the other tests, unless
    not shared_home: then the check's own, in the scratch folder, as on the GPU machine)."""
    from draftsmith.sampling.machine import cache_home

    env = {**os.environ, "GPU_CHECK_DEVICE": "cpu", "GPU_CHECK_SCRATCH": str(scratch),
           "DRAFTSMITH_HOME": str(cache_home()), "GPU_CHECK_WHEELS": str(scratch / "no-wheels"), **env}
    if not shared_home:
        del env["DRAFTSMITH_HOME"]
    if steps:
        env["GPU_CHECK_STEPS"] = steps
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(out)], capture_output=True, text=True,
                          timeout=timeout, env=env)


def returned(out: Path) -> list[Path]:
    """OUT as the GPU machine sends it back: at most 8 files of at most 16 MiB, nothing else."""
    files = list(out.iterdir())
    assert len(files) <= 8 and all(f.is_file() and f.stat().st_size <= 16 * MiB for f in files), files
    return files


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_the_gpu_check_refuses_without_cuda_in_one_line(tmp_path):
    res = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path)], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip().count("\n") == 0
    assert "no CUDA device" in res.stderr and "GPU_CHECK_DEVICE=cpu" in res.stderr


@pytest.mark.slow  # among the longest (~20 s): the default suite stays under its 12 minutes
def test_a_training_step_runs_under_timeout_and_out_keeps_only_logs_and_the_summary(tmp_path):
    """The training steps run `python -m draftsmith.train.draft` (a shell function under `timeout` failed with rc 127);
    the run itself goes to the scratch folder, OUT keeps the part's log and summary.json with the step's figure rows;
    a rerun into the same OUT skips the step."""
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    res = run_check(out, scratch, steps="plan_8b")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert "[ok] plan_8b" in res.stdout and "draft:" in res.stdout
    steps = json.loads((out / "summary.json").read_text())["steps"]
    assert list(steps) == ["plan_8b"] and steps["plan_8b"]["ok"] and steps["plan_8b"]["rows"]
    assert sorted(f.name for f in returned(out)) == ["b.log", "freeze.txt", "machine.txt", "summary.json"]
    assert (scratch / "runs" / "plan8b").is_dir()
    again = run_check(out, scratch, steps="plan_8b")
    assert again.returncode == 0 and "[skip] plan_8b" in again.stdout and "[ok]" not in again.stdout


@pytest.mark.slow  # among the longest (~20 s): the default suite stays under its 12 minutes
def test_a_step_stopped_by_the_deadline_leaves_its_log_and_the_next_has_no_time(tmp_path):
    """GPU_CHECK_DEADLINE_S: a step that outlasts what is left of it (here one that ignores TERM, so timeout's KILL
    stops it) leaves its log's tail in OUT and a "timeout" entry; the step after it is not started and is recorded
    "no time"; the check ends before the deadline. Before (the step's log copied only when the step ended, limits
    adding up past the command's), the device tool's kill came first and left nothing. OUT's first files hold the
    machine's package list and df; a temporary model folder a killed save left in the check's own home is removed.
    The stand-in Python runs the real one for everything but the header (5-10 s of imports the deadline would have
    to absorb on a loaded CI machine) and plan_8b's command, which sleeps."""
    import time

    python = tmp_path / "python"
    python.write_text(f"""#!/usr/bin/env bash
[ "$1" = -c ] && {{ echo "gpu_check: header left out by the test"; exit 0; }}
if [[ " $* " == *" plan=true "* ]]; then trap "" TERM; echo "plan_8b started"; sleep 120; echo "plan_8b ended"; fi
exec {sys.executable} "$@"
""")
    python.chmod(0o755)
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    models = scratch / "home" / "models"
    (models / ".random-llama3-8b-shape.k2x9w0q1").mkdir(parents=True)  # a killed save's temporary folder
    (models / "tiny-random").mkdir()
    deadline = 25  # the sleeping step gets 15 s less the check's start (pip freeze: 1-5 s on a loaded machine)
    t0 = time.monotonic()
    res = run_check(out, scratch, steps="plan_8b visits_8b", shared_home=False, PYTHON=str(python),
                    GPU_CHECK_DEADLINE_S=str(deadline))
    took = time.monotonic() - t0
    assert res.returncode == 1, res.stdout + res.stderr
    assert took < deadline + 2, took
    assert "[TIMEOUT] plan_8b" in res.stdout and "[no time] visits_8b" in res.stdout, res.stdout
    steps = json.loads((out / "summary.json").read_text())["steps"]
    assert steps["plan_8b"]["status"] == "timeout" and steps["plan_8b"]["rc"] == 137 and not steps["plan_8b"]["ok"]
    assert steps["visits_8b"]["status"] == "no time" and not steps["visits_8b"]["ok"]
    log = (out / "b.log").read_text()
    assert "plan_8b started" in log and "plan_8b ended" not in log and "stopped at its limit" in log
    assert sorted(f.name for f in returned(out)) == ["b.log", "freeze.txt", "machine.txt", "summary.json"]
    assert "pytest==" in (out / "freeze.txt").read_text()
    machine = (out / "machine.txt").read_text()
    assert "removed" in machine and "Avail" in machine  # df -h's header
    assert sorted(p.name for p in models.iterdir()) == ["tiny-random"]


def test_a_step_without_a_figure_row_fails(tmp_path):
    """Exit 0 is not enough: a step whose log has none of its figure rows fails (the summary's case-sensitive greps
    matched no row, and the check passed with headers only)."""
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    (scratch / "runs" / "train8b").mkdir(parents=True)  # no metrics.csv: visits_8b has no row to print
    res = run_check(out, scratch, steps="visits_8b")
    assert res.returncode == 1 and "[FAILED rc=1] visits_8b" in res.stdout
    assert not json.loads((out / "summary.json").read_text())["steps"]["visits_8b"]["ok"]


def test_a_draftsmith_wheel_from_another_tree_is_refused(tmp_path):
    """The draftsmith wheel carried to the GPU machine is checked against the tree it runs in: an edit after
    fetching (here: one module changed inside the wheel) is refused in one line before anything runs."""
    src = tmp_path / "src"  # built from a copy: setuptools writes build/ and egg-info beside the sources
    # the working tree as it is (the check compares the wheel with it): new files git does not track yet, and not
    # the ones deleted but still tracked
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        if not (ROOT / name).is_file():
            continue
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes((ROOT / name).read_bytes())
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "whl"), str(src)], check=True, capture_output=True)
    wheel = next((tmp_path / "whl").glob("draftsmith-*.whl"))
    helper = [sys.executable, str(ROOT / "scripts" / "gpu_check_summary.py"), "wheel-matches"]
    assert subprocess.run([*helper, str(wheel)]).returncode == 0

    stale = tmp_path / "stale" / wheel.name
    stale.parent.mkdir()
    with zipfile.ZipFile(wheel) as a, zipfile.ZipFile(stale, "w") as b:
        for item in a.infolist():
            data = a.read(item)
            b.writestr(item, data + b"# edited\n" if item.filename == "draftsmith/sampling/probs.py" else data)
    bad = subprocess.run([*helper, str(stale)], capture_output=True, text=True)
    assert bad.returncode == 1 and "sampling/probs.py differs" in bad.stderr
    res = run_check(tmp_path / "out", tmp_path / "scratch", GPU_CHECK_WHEELS=str(stale.parent))
    assert res.returncode == 2 and res.stdout == "" and res.stderr.strip().count("\n") == 0
    assert "built from another tree" in res.stderr and "fetch_gpu_wheels.sh" in res.stderr


def test_a_random_target_is_its_shape_with_random_weights(tmp_path, monkeypatch):
    """`random:SHAPE:LAYERS`: the shape's config cut to LAYERS layers, random weights, tiny-random's tokenizer; its
    config is read without building it (`config_of`, for plan=true)."""
    from draftsmith.sampling import load, names

    shape = tmp_path / "shape"
    shape.mkdir()
    (shape / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2}))
    monkeypatch.setitem(names.ALIASES, "tiny-shape", names._Shape(str(shape)))  # an absolute folder
    monkeypatch.setenv("DRAFTSMITH_HOME", str(tmp_path / "home"))
    assert names.config_of("random:tiny-shape:2").num_hidden_layers == 2
    assert not (tmp_path / "home" / "models").exists() or not any((tmp_path / "home" / "models").glob("random*"))
    model, tok = load.load_model("random:tiny-shape:2", "fp32"), load.load_tokenizer("random:tiny-shape:2")
    assert model.config.num_hidden_layers == 2 and model.config.vocab_size == 1000 and len(tok) == 512
    assert model.config.eos_token_id == tok.eos_token_id
    with pytest.raises(load.DraftsmithError, match="random:SHAPE or random:SHAPE:LAYERS"):
        names.resolve("random:tiny-shape:x")


def test_the_sampler_bench_measures_c_and_v_without_compile(tmp_path, capsys):
    """The GPU check's cost rows come from `bench sampler` without --compile: every draft but the target itself gets
    its c and v(K) measured eagerly, the paper-shaped draft among them (before, only --compile measured any)."""
    from draftsmith.deploy.bench import sampler

    out = tmp_path / "bench.json"
    assert sampler.main(["--target", "tiny-random", "--device", "cpu", "--dtype", "fp32", "--cut-layers", "1",
                         "--paper-draft", "--n-prompts", "1", "--max-new-tokens", "4", "-k", "2", "--json",
                         str(out)]) == 0
    costs = json.loads(out.read_text())["costs"]
    assert set(costs) == {"cut", "paper"}
    assert all(c["c"] > 0 and set(c["v"]) == {"1", "2"} for c in costs.values())
    printed = capsys.readouterr().out
    assert "ours_sps_self" in printed and "ours_sps_paper" in printed
    assert [ln.split()[0] for ln in printed.splitlines() if " c=" in ln] == ["cut", "paper"]


def test_the_demo_shape_is_the_demo_targets_config():
    """`random:smollm2-135m-shape`: the demo target's shape (SmolLM2-135M-Instruct) for its c and v(K) on a GPU,
    where its 93 MB of weights cannot be carried."""
    from draftsmith.sampling.names import config_of

    c = config_of("random:smollm2-135m-shape")
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.vocab_size) == (30, 576, 1536, 49152)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.tie_word_embeddings) == (9, 3, 64, True)


STEPS = {"devices", "exactness", "costs_8b", "costs_demo", "smoke", "smoke_export", "plan_8b", "train_8b", "visits_8b"}


@pytest.fixture(scope="module")
def image_copy(tmp_path_factory):
    """The GPU machine's image copied (scripts/gpu_image.txt in a venv of its own, made once; Python 3.11, torch 2.13
    CPU and numpy 2.4 standing in for its 3.12, CUDA torch and numpy 2.5) and the wheels the resolver chose against
    it: for 3.12, what is carried (64 MiB at most with the tree), and for 3.11, the same set installed in the copy as
    the GPU machine installs it (--no-index --no-deps --target, then PYTHONPATH)."""
    from draftsmith.sampling.machine import cache_home

    tmp = tmp_path_factory.mktemp("image")
    venv = Path(os.environ.get("GPU_IMAGE_VENV") or cache_home() / "gpu-image-venv")
    env = dict(os.environ, GPU_IMAGE_VENV=str(venv))
    sets = {}
    for pyv in ("3.12", "3.11"):
        res = subprocess.run(["bash", str(ROOT / "scripts" / "fetch_gpu_wheels.sh"), str(tmp / pyv)],
                             capture_output=True, text=True, timeout=900, env=dict(env, GPU_WHEELS_PYTHON=pyv))
        assert res.returncode == 0, res.stderr[-3000:]
        sets[pyv] = sorted((tmp / pyv).glob("*.whl"))
        print(res.stdout.strip())
    python, site = venv / "bin" / "python", tmp / "site"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site),
                    *map(str, sets["3.11"])], check=True, capture_output=True)
    return {"python": python, "site": site, "sets": sets, "wheels": tmp / "3.11", "env": env}


def top_level(wheel: Path) -> set[str]:
    """The modules a wheel puts at the top of site-packages, read off its file list."""
    with zipfile.ZipFile(wheel) as z:
        heads = {n.split("/")[0] + ("/" if "/" in n else "") for n in z.namelist()}
    names = set()
    for h in heads:
        if h.endswith(("/", ".py")) and not h.rstrip("/").endswith((".dist-info", ".data")):
            names.add(h.rstrip("/").removesuffix(".py"))
        elif h.endswith(".so"):  # an extension module: NAME.cpython-311-x86_64-linux-gnu.so or NAME.abi3.so
            names.add(h.split(".")[0])
    return {n for n in names if n.isidentifier()}


@pytest.mark.slow
def test_every_carried_package_imports_in_the_image_copy(image_copy, tmp_path):
    """Each carried wheel's top-level modules import in the copy with only the image and the carried set on the path
    (not this tree, not the dev venv): a package the image lacks and nothing carries fails here. Before,
    scripts/gpu_image.txt listed pydantic, which the image does not have: nothing carried it, and `import deepspeed`
    (all four ZeRO steps of part c) would have failed on the GPU machine while the check that deepspeed is carried
    passed."""
    modules = sorted({m for w in image_copy["sets"]["3.11"] for m in top_level(w)})
    assert {"deepspeed", "pydantic", "hydra", "transformers", "datasets", "draftsmith"} <= set(modules), modules
    probe = f"""import importlib, sys, warnings
warnings.simplefilter("ignore")
root = {str(ROOT)!r}
assert not [p for p in sys.path if p.startswith(root)], sys.path
failed = {{}}
for m in {modules!r}:
    try:
        importlib.import_module(m)
    except Exception as e:
        failed[m] = f"{{type(e).__name__}}: {{e}}"
print(f"imported {{len({modules!r}) - len(failed)}} of {{len({modules!r})}} top-level modules:", " ".join({modules!r}))
for m, e in failed.items():
    print("FAILED", m, e)
sys.exit(1 if failed else 0)
"""
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PYTHONPATH": str(image_copy["site"])}
    res = subprocess.run([str(image_copy["python"]), "-s", "-c", probe], capture_output=True, text=True, cwd=tmp_path,
                         env=env, timeout=600)
    print(res.stdout)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


@pytest.mark.slow
def test_the_dry_run_passes_in_a_copy_of_the_gpu_image(image_copy, tmp_path):
    """The whole CPU dry run in the image copy with the carried wheels: every step passes with figure rows, OUT is
    what comes back from the machine, a rerun into the same OUT skips every step, and one after the scratch folder
    was deleted runs again a passed step whose output a step still to pass reads (train_8b for visits_8b) and
    passes. Before, the skip looked at summary.json alone: train_8b was skipped and visits_8b failed."""
    python, wheels, env = image_copy["python"], image_copy["wheels"], image_copy["env"]
    sets = image_copy["sets"]
    carried = {p.name.split("-")[0].lower() for p in sets["3.12"]}
    assert {"draftsmith", "transformers", "hydra_core", "omegaconf", "datasets", "deepspeed", "pydantic"} <= carried
    # the image's own stay: transformers must be one that imports with its huggingface_hub 1.33.0
    assert not carried & {"huggingface_hub", "torch", "lightning", "tokenizers", "numpy", "wandb"}, carried
    tree = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.decode()
    tree_bytes = sum((ROOT / f).stat().st_size for f in filter(None, tree.split("\0")) if (ROOT / f).is_file())
    assert sum(p.stat().st_size for p in sets["3.12"]) + tree_bytes <= 64 * MiB

    probe = subprocess.run([str(python), "-c", "import draftsmith.sampling, draftsmith.train, draftsmith.deploy, "
                            "draftsmith.train.draft, transformers, huggingface_hub as h; "
                            "print(draftsmith.sampling.__file__, transformers.__version__, h.__version__)"],
                           capture_output=True, text=True, cwd=tmp_path,
                           env=dict(env, PYTHONPATH=str(image_copy["site"])))
    assert probe.returncode == 0, probe.stderr[-3000:]
    where, transformers_version, hub_version = probe.stdout.split()
    assert where.startswith(str(image_copy["site"])) and transformers_version.startswith("5.24")
    assert hub_version == "1.33.0"

    out, scratch = tmp_path / "out", tmp_path / "scratch"
    # the CPU's steps are slower than the GPU's: a deadline for this machine, not the device tool's
    check = dict(PYTHON=str(python), GPU_CHECK_WHEELS=str(wheels), GPU_CHECK_DEADLINE_S="1500")
    res = run_check(out, scratch, timeout=1600, **check)
    print(res.stdout)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "transformers 5.24" in res.stdout.splitlines()[0]
    assert "[cpu stand-in] devices:" in res.stdout
    steps = json.loads((out / "summary.json").read_text())["steps"]
    assert set(steps) == STEPS and all(s["ok"] and s["status"] == "ok" and s["rows"] for s in steps.values())
    assert any(" c=" in r for r in steps["costs_8b"]["rows"])
    assert any("ours_ars" in r for r in steps["costs_8b"]["rows"])
    assert any("revisits" in r for r in steps["visits_8b"]["rows"])
    assert sorted(f.name for f in returned(out)) == ["a.log", "b.log", "freeze.txt", "machine.txt", "summary.json"]
    assert "torch==2.13.0+cpu" in (out / "freeze.txt").read_text()  # the copy's own list, before the wheels
    again = run_check(out, scratch, timeout=300, **check)
    assert again.returncode == 0 and again.stdout.count("[skip]") == len(STEPS) and "[ok]" not in again.stdout
    assert "not again" in (out / "machine.txt").read_text()  # the same wheels: not installed twice

    # A retry on a fresh machine: the scratch folder is gone, and visits_8b had not passed (the first lease ran out
    # as it started). Its producer runs again; before, train_8b was skipped and visits_8b failed on no run folder.
    summary = json.loads((out / "summary.json").read_text())
    summary["steps"]["visits_8b"].update(ok=False, status="timeout", rc=124)
    (out / "summary.json").write_text(json.dumps(summary))
    shutil.rmtree(scratch)
    fresh = run_check(out, scratch, "train_8b visits_8b", timeout=1600, **check)
    print(fresh.stdout)
    assert fresh.returncode == 0, fresh.stdout[-4000:] + fresh.stderr[-2000:]
    assert "[again] train_8b" in fresh.stdout and "[ok] train_8b" in fresh.stdout and "[ok] visits_8b" in fresh.stdout
    steps = json.loads((out / "summary.json").read_text())["steps"]
    assert set(steps) == STEPS and all(s["ok"] for s in steps.values())
