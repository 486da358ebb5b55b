"""Killed at any moment, run side by side: target-sample generation resumes to the same file an uninterrupted run
writes, an export leaves the previous bundle intact and never a partial one, two exports to one place both land
whole, and two training runs never share a run directory (issue 11)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from draftsmith.deploy.conformance import open_bundle

GENERATE = """
import sys
from draftsmith.sampling.load import load_model, load_tokenizer
from draftsmith.data.corpus import generate_corpus
prompts = [f"prompt {i}:" for i in range(int(sys.argv[2]))]
generate_corpus(load_model("tiny-random", "fp32"), load_tokenizer("tiny-random"), prompts, sys.argv[1],
                max_new_tokens=24, batch_size=4, progress=False)
"""


def _start(code: str, *args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def _kill_when(proc: subprocess.Popen, ready, timeout: float = 120) -> bool:
    """SIGKILL `proc` as soon as ready() holds; False if it finished first."""
    t0 = time.time()
    while not ready() and proc.poll() is None and time.time() - t0 < timeout:
        time.sleep(0.01)
    if proc.poll() is not None:
        return False
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return True


def _generate(path, n):
    from draftsmith.data.corpus import generate_corpus
    from draftsmith.sampling.load import load_model, load_tokenizer

    generate_corpus(load_model("tiny-random", "fp32"), load_tokenizer("tiny-random"),
                    [f"prompt {i}:" for i in range(n)], path, max_new_tokens=24, batch_size=4, progress=False)


def test_generation_killed_midway_resumes_to_the_uninterrupted_file(tmp_path):
    whole, resumed = tmp_path / "whole.jsonl", tmp_path / "resumed.jsonl"
    _generate(whole, 120)
    proc = _start(GENERATE, resumed, 120)
    lines = lambda: resumed.read_bytes().count(b"\n") if resumed.exists() else 0  # noqa: E731
    assert _kill_when(proc, lambda: lines() >= 5), "generation finished before it could be killed"
    with resumed.open("ab") as f:  # and a row torn mid-write, as a kill inside a buffered write leaves it
        f.write(b'{"text": "prompt 99: torn')
    _generate(resumed, 120)  # resumes after the whole batches, drops the rest
    assert resumed.read_text() == whole.read_text()


EXPORT = """
import sys
from draftsmith.deploy.export import export
export(sys.argv[1], sys.argv[2], n_prompts=1, max_new_tokens=8, ks=(1, 2))
"""


@pytest.fixture(scope="module")
def first_bundle(smoke_run, tmp_path_factory):
    from draftsmith.deploy.export import export

    run_dir, _ = smoke_run
    out = tmp_path_factory.mktemp("kill") / "pair"
    export(run_dir, out, n_prompts=1, max_new_tokens=8, ks=(1, 2))
    return run_dir, out


def test_export_killed_midway_leaves_the_previous_bundle_and_the_next_export_cleans_up(first_bundle):
    from draftsmith.deploy.export import export

    run_dir, out = first_bundle
    before = json.loads((out / "speculative.json").read_text())["files"]
    partials = lambda: list(out.parent.glob(f".{out.name}.partial-*"))  # noqa: E731
    proc = _start(EXPORT, run_dir, out)
    assert _kill_when(proc, lambda: any((p / "draft").exists() for p in partials())), proc.stderr.read()[-2000:]
    assert json.loads((out / "speculative.json").read_text())["files"] == before
    open_bundle(out)  # every file still matches its recorded hash
    assert partials()  # what the killed export left...
    export(run_dir, out, n_prompts=1, max_new_tokens=8, ks=(1, 2))
    assert not partials() and not list(out.parent.glob(f".{out.name}.previous"))  # ...the next one removed
    open_bundle(out)


# an export that logs when it asks for the bundle's lock ("wants"), when it writes the draft ("write": held there
# until the other export has asked for the lock too, so that the two contend) and when its locked region ends
# ("leave", still inside it)
EXPORT_LOGGED = """
import contextlib, os, sys, time
import draftsmith.deploy.export as export
def event(what):
    with open(sys.argv[3], "a") as log:
        log.write(f"{what} {os.getpid()}\\n")
def events():
    return [ln.split() for ln in open(sys.argv[3]).read().splitlines()]
real_exclusive, real_save = export._exclusive, export.save_draft
@contextlib.contextmanager
def exclusive(out):
    event("wants")
    with real_exclusive(out):
        yield
        event("leave")
def save_draft(*a, **kw):
    event("write")
    t0 = time.time()
    while not any(e[0] == "wants" and e[1] != str(os.getpid()) for e in events()) and time.time() - t0 < 120:
        time.sleep(0.1)
    time.sleep(1)
    real_save(*a, **kw)
export._exclusive, export.save_draft = exclusive, save_draft
export.export(sys.argv[1], sys.argv[2], n_prompts=1, max_new_tokens=8, ks=(1, 2))
"""


def test_two_exports_to_one_place_both_land_whole(first_bundle, tmp_path):
    """Two exports to one place at once: each asks for the bundle's lock while the other holds it writing, and the
    second writes only after the first has swapped its bundle in (their locked regions, the draft's writing inside,
    never overlap); both land whole, leaving only the lock file."""
    run_dir, out = first_bundle
    log = tmp_path / "log"
    procs = [_start(EXPORT_LOGGED, run_dir, out, log) for _ in range(2)]
    assert [p.wait() for p in procs] == [0, 0], [p.stderr.read()[-2000:] for p in procs]
    events = [ln.split() for ln in log.read_text().splitlines()]
    first_leave = next(i for i, e in enumerate(events) if e[0] == "leave")
    assert sum(e[0] == "wants" for e in events[:first_leave]) == 2, events  # they contended for the lock
    held = [e for e in events if e[0] != "wants"]
    a, b = held[0][1], held[2][1]
    assert held == [["write", a], ["leave", a], ["write", b], ["leave", b]] and a != b, events
    open_bundle(out)
    assert sorted(p.name for p in out.parent.iterdir() if p.name.startswith(".")) == [f".{out.name}.lock"]


CLAIM = """
import sys, time
from pathlib import Path
from draftsmith.train.rundir import claim_run_dir
claim_run_dir(Path(sys.argv[1]))
print("claimed", flush=True)
time.sleep(600)
"""


def test_a_run_dir_is_held_by_one_run_and_freed_when_that_run_is_killed(tmp_path):
    from draftsmith.sampling.errors import DraftsmithError
    from draftsmith.train.rundir import claim_run_dir

    proc = subprocess.Popen([sys.executable, "-c", CLAIM, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "claimed"
    with pytest.raises(DraftsmithError, match=rf"in use by another training run \(pid {proc.pid}\)"):
        claim_run_dir(tmp_path)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    claim_run_dir(tmp_path)  # a killed run leaves no stale claim


def test_runs_started_in_the_same_second_get_their_own_run_dirs():
    from conftest import ROOT
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import draftsmith.train.draft  # noqa: F401  (registers the resolver the default run dir uses)

    with initialize_config_dir(str(ROOT / "recipes"), version_base="1.3"):
        cfg = compose("draft", return_hydra_config=True)
    run_dir = OmegaConf.to_container(cfg.hydra.run, resolve=True)["dir"]
    assert run_dir.startswith("outputs/") and run_dir.endswith(f"-{os.getpid()}")


TOKENIZE = """
import sys, time
from pathlib import Path
import draftsmith.data.corpus as corpus
from draftsmith.sampling.load import load_tokenizer
real = corpus.save_file
def half_written(tensors, path):  # the kill lands mid-write: half the file's bytes on disk, then held there
    real(tensors, path)
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: len(data) // 2])
    Path(sys.argv[2]).touch()
    time.sleep(120)
corpus.save_file = half_written
corpus.load_blocks(sys.argv[1], load_tokenizer("tiny-random"), 64)
"""


def test_tokenisation_killed_midway_leaves_no_cache_and_a_damaged_cache_is_rebuilt(tmp_path):
    """Killed while writing the tokenized blocks (half the file on disk): nothing is left under the cache's name (a
    writer straight to that name would leave the torn half there), and the next run builds the blocks an
    uninterrupted run builds; a cache file damaged on disk is rebuilt, not read."""
    import torch

    from draftsmith.data.corpus import blocks_cache, load_blocks
    from draftsmith.sampling.load import load_tokenizer

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(400):
        (corpus / f"doc{i}.txt").write_text(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" * 200)
    tok = load_tokenizer("tiny-random")
    cached = blocks_cache(str(corpus), tok, 64)
    writing = tmp_path / "writing"
    proc = _start(TOKENIZE, corpus, writing)
    killed = _kill_when(proc, writing.exists)
    assert killed and writing.exists(), "the blocks were never written: " + proc.stderr.read()[-2000:]
    assert not cached.exists()
    blocks = load_blocks(str(corpus), tok, 64)
    assert cached.is_file() and len(blocks["train"]) > 100
    cached.write_bytes(cached.read_bytes()[:1000])  # torn on disk
    with pytest.warns(UserWarning, match="rebuilding"):
        again = load_blocks(str(corpus), tok, 64)
    assert all(torch.equal(again[k], blocks[k]) for k in blocks)
