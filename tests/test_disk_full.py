"""A full disk at scale (issue 44): the writers of the run's big files (the target's samples and kept logits, the
teacher store, the tokenized blocks, the checkpoints) meet ENOSPC with one line naming what, where, how much, and
what a rerun does; nothing written before is lost, and the work resumes once space is freed. The disk is real: a
small tmpfs mounted in a user and mount namespace of the test's own (`unshare -rm`), filled with a ballast file
that is removed to free the space."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import missing_resource

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "disk_full_worker.py"


@pytest.fixture(scope="session")
def small_fs(tmp_path_factory):
    """Runs a worker job with a tmpfs of a given size at a fresh mount point. Where this machine lets no unprivileged
    process mount one, skips saying why, or fails where DRAFTSMITH_REQUIRE names tmpfs (CI)."""
    if shutil.which("unshare") is None:
        missing_resource("tmpfs", "no `unshare` here (util-linux) to mount one in a namespace of the test's own")
    probe = tmp_path_factory.mktemp("probe")
    res = subprocess.run(["unshare", "-r", "-m", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {probe}"],
                         capture_output=True, text=True)
    if res.returncode:
        missing_resource("tmpfs", f"`unshare -rm` + `mount -t tmpfs` refused ({res.stderr.strip()})")

    def run(tmp_path, size: str, job: str, *args, timeout=600) -> dict:
        mount, result = tmp_path / "disk", tmp_path / "result.json"
        mount.mkdir()
        script = 'mount -t tmpfs -o size="$1" tmpfs "$2" && shift 2 && exec "$@"'
        res = subprocess.run(["unshare", "-r", "-m", "sh", "-c", script, "sh", size, str(mount), sys.executable,
                              str(WORKER), job, str(mount), str(result), *map(str, args)], capture_output=True,
                             text=True, timeout=timeout)
        assert res.returncode == 0, res.stderr[-3000:]
        return json.loads(result.read_text())

    return run


def _one_line(error: str, *parts: str):
    print(error)
    assert error.startswith("disk full: could not write ") and "\n" not in error
    assert all(p in error for p in parts), error


def test_sampling_the_corpus_onto_a_full_disk_stops_in_one_line_and_resumes_to_the_same_files(tmp_path, small_fs):
    from draftsmith.data.corpus import generate_corpus
    from draftsmith.sampling.load import load_model, load_tokenizer

    ref = tmp_path / "ref.jsonl"  # an uninterrupted run on a roomy disk
    generate_corpus(load_model("tiny-random", "fp32"), load_tokenizer("tiny-random"),
                    [f"prompt {i}:" for i in range(48)], ref, max_new_tokens=24, batch_size=4, progress=False,
                    keep_logits=4)
    r = small_fs(tmp_path, "4m", "generate", ref, 48)
    _one_line(r["error"], "the target's samples (draftsmith)", "gen.jsonl", "needed", "free there",
              "samples written are kept and sampling continues after them")
    assert 0 < r["rows_at_error"] < 48  # stopped midway
    assert r["same_rows"] and r["same_logits"] and r["logits_files"] == 12  # nothing lost, nothing torn


def test_the_teacher_store_on_a_full_disk_keeps_its_blocks_and_refills_after_space_is_freed(tmp_path, small_fs):
    r = small_fs(tmp_path, "8m", "store")
    _one_line(r["error"], "the teacher store (the target's kept logits)", "needed", "ckpt_path=last")
    assert 0 < r["blocks_at_error"] < 400 and r["filled_at_error"] >= r["blocks_at_error"]
    assert r["whole_before"] and r["whole_after"]


def test_the_blocks_cache_on_a_full_disk_leaves_no_torn_file_and_is_written_after_space_is_freed(tmp_path, small_fs):
    import hashlib

    from draftsmith.data.corpus import load_blocks
    from draftsmith.sampling.load import load_tokenizer

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(60):
        (corpus / f"doc{i}.txt").write_text(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" * 60)
    blocks = load_blocks(str(corpus), load_tokenizer("tiny-random"), 64)  # the reference, cached elsewhere
    digest = hashlib.sha256(blocks["train"].numpy().tobytes()).hexdigest()
    r = small_fs(tmp_path, "4m", "blocks", corpus)
    _one_line(r["error"], "the tokenized blocks", "needed", "rerun")
    assert r["left_behind"] == []  # no torn cache, no temporary file
    assert r["cached"] and r["digest"] == digest


@pytest.mark.slow  # among the longest: the default suite stays under its 12 minutes
def test_a_run_whose_disk_fills_stops_at_a_checkpoint_in_one_line_and_resumes_after_space_is_freed(tmp_path,
                                                                                                    small_fs):
    """A real training run with its run directory on the small disk: filled after its first checkpoint, it stops
    at the next with one line, exit 2, its last checkpoint whole; freed, `ckpt_path=last` finishes it."""
    r = small_fs(tmp_path, "64m", "train", ROOT, timeout=1200)
    print(r)
    assert r["rc"] == 2
    _one_line(r["stderr_tail"][0].removeprefix("error: "), "checkpoint", "needed",
              "the checkpoints written before are whole", "ckpt_path=last")
    assert r["last_step"] >= r["filled_at_step"] and r["last_step"] < 12
    assert not [c for c in r["checkpoints"] if c.startswith(".")]  # no partial file left
    assert r["resumed_rc"] == 0, r["resumed_stderr"]
    assert r["resumed_step"] == 12
