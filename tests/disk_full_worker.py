"""Run by tests/test_disk_full.py inside a user and mount namespace with a small tmpfs at MOUNT: each writer of
the run's big files meets a real full disk (ENOSPC), then space is freed (the ballast file removed) and the work
resumes. What happened goes to RESULT (a JSON file outside the tmpfs, which is gone when this process ends).

    python disk_full_worker.py generate|store|blocks|train MOUNT RESULT [ARGS...]
"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from draftsmith.data.diskfull import DiskFull

job, mount, result_path = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
args = sys.argv[4:]
ballast = mount / "ballast"
result = {}


def fill(leave: int = 0) -> None:
    """Take the tmpfs' free space but `leave` bytes (0: write until the disk is full)."""
    with ballast.open("ab") as f:
        for chunk in (1 << 20, 1 << 16, 1 << 12):
            while shutil.disk_usage(mount).free - chunk >= leave:
                try:
                    f.write(b"\0" * chunk)
                    f.flush()
                except OSError:
                    break


def free_space() -> None:
    ballast.unlink()


if job == "generate":  # the target's samples and kept logits, against an uninterrupted run's files (ARGS: REF, N)
    from draftsmith.data.corpus import generate_corpus, logits_dir
    from draftsmith.sampling.load import load_model, load_tokenizer

    ref, n = Path(args[0]), int(args[1])
    out = mount / "gen.jsonl"

    def generate():
        generate_corpus(load_model("tiny-random", "fp32"), load_tokenizer("tiny-random"),
                        [f"prompt {i}:" for i in range(n)], out, max_new_tokens=24, batch_size=4, progress=False,
                        keep_logits=4)

    on_disk = ref.stat().st_size + sum(f.stat().st_size for f in logits_dir(ref).iterdir())
    fill(leave=on_disk // 2)
    try:
        generate()
    except DiskFull as e:
        result["error"] = str(e)
    result["rows_at_error"] = out.read_bytes().count(b"\n")
    free_space()
    generate()
    result["same_rows"] = out.read_bytes() == ref.read_bytes()
    files = lambda p: {f.name: f.read_bytes() for f in logits_dir(p).iterdir()}  # noqa: E731
    result["same_logits"] = files(out) == files(ref)
    result["logits_files"] = len(files(out))

elif job == "store":  # the teacher store: blocks written before the disk filled read back whole; the rest after
    from draftsmith.data.teacher import TeacherCache, top_logprobs

    cache = TeacherCache(400, 63, 16, 512, directory=mount)
    torch.manual_seed(0)
    logits = torch.randn(400, 63, 512)
    fill(leave=cache.record * 150)  # about 150 of the 400 blocks fit (the file is sparse: pages as written)
    done = 0
    try:
        for lo in range(0, 400, 10):
            rows = torch.arange(lo, lo + 10)
            cache.logits(rows, lambda miss, rows=rows: logits[rows][miss])
            done = lo + 10
    except DiskFull as e:
        result["error"] = str(e)
    result["blocks_at_error"] = done
    result["filled_at_error"] = int(cache.filled.sum())
    want = top_logprobs(logits, 16)
    kept = cache.read(torch.arange(done))
    result["whole_before"] = bool(torch.equal(kept["values"], want[0][:done]))
    free_space()
    all_rows = torch.arange(400)
    got = cache.logits(all_rows, lambda miss: logits[miss])
    kept = cache.read(all_rows)
    result["whole_after"] = bool(torch.equal(kept["values"], want[0]) and torch.equal(kept["index"], want[1]))
    result["misses"] = cache.misses

elif job == "blocks":  # the tokenized-blocks cache under DRAFTSMITH_HOME (ARGS: CORPUS, the reference digest)
    import hashlib

    from draftsmith.data.corpus import blocks_cache, load_blocks
    from draftsmith.sampling.load import load_tokenizer

    tok = load_tokenizer("tiny-random")  # materialised under the usual home first
    os.environ["DRAFTSMITH_HOME"] = str(mount / "home")  # the blocks cache on the small disk
    cached = blocks_cache(args[0], tok, 64)
    fill(leave=64 << 10)
    try:
        load_blocks(args[0], tok, 64)
    except DiskFull as e:
        result["error"] = str(e)
    result["left_behind"] = sorted(str(p.relative_to(mount)) for p in (mount / "home").rglob("*") if p.is_file())
    free_space()
    blocks = load_blocks(args[0], tok, 64)
    result["cached"] = cached.is_file()
    result["digest"] = hashlib.sha256(blocks["train"].numpy().tobytes()).hexdigest()

elif job == "train":  # checkpoints: a run whose disk fills after its first checkpoint, then resumed (ARGS: ROOT)
    root = Path(args[0])
    run = mount / "run"
    cmd = [sys.executable, str(root / "train" / "draft.py"), "recipe=smoke", f"hydra.run.dir={run}", "logger=csv",
           "loss.teacher_topk=0", "trainer.max_steps=12"]  # no teacher store: the checkpoints are what fills
    proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    last = run / "checkpoints" / "last.ckpt"
    while not last.exists() and proc.poll() is None:
        time.sleep(0.01)
    fill()
    result["filled_at_step"] = torch.load(last, weights_only=True)["global_step"]
    _, err = proc.communicate()
    result["rc"] = proc.returncode
    result["stderr_tail"] = err.strip().splitlines()[-1:] if err.strip() else []
    result["last_step"] = torch.load(last, weights_only=True)["global_step"]  # whole: it loads
    result["checkpoints"] = sorted(p.name for p in (run / "checkpoints").iterdir())
    free_space()
    again = subprocess.run(cmd + ["ckpt_path=last"], cwd=root, capture_output=True, text=True)
    result["resumed_rc"] = again.returncode
    result["resumed_stderr"] = again.stderr[-2000:] if again.returncode else ""
    result["resumed_step"] = torch.load(last, weights_only=True)["global_step"]

result_path.write_text(json.dumps(result))
