"""Shared helpers: the exactness tests' statistics (the same chi-square that judges engines), and the count of an
engine's processes left behind."""

import os
import time
from collections import defaultdict
from pathlib import Path

import torch

from draftsmith.sampling.exactness import chi2_pvalue


def counts_of(gen) -> dict:
    """How often each generated row (a tuple of token ids) occurs in a batched generation."""
    counts = defaultdict(int)
    for t in gen.tokens:
        counts[tuple(t.tolist())] += 1
    return counts


def sample_counts(fn, n_rows, budget, prompt):
    """(counts, stats) of `fn` run once on `n_rows` copies of `prompt` (`budget`: the tokens each row may add)."""
    gen = fn(torch.tensor([prompt]).repeat(n_rows, 1))
    return counts_of(gen), gen.stats


def pvalue(counts, exact) -> float:
    """Chi-square p-value of sequence counts against exact sequence probabilities."""
    keys = sorted(set(exact) | set(counts))
    return chi2_pvalue([counts.get(s, 0) for s in keys], [exact.get(s, 0.0) for s in keys])


def fit_losses(module, blocks, tmp_path, steps: int = 6) -> list[float]:
    """A real Lightning fit of `module` on `blocks` (batches of 4, with their row indices, no validation): the
    train/loss of every step."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    seen = []
    module.log = lambda name, v, **kw: seen.append(float(v)) if name == "train/loss" else None
    data = DataLoader(TensorDataset(blocks, torch.arange(len(blocks))), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, default_root_dir=tmp_path, limit_val_batches=0)
    trainer.fit(module, data)
    return seen


def wandb_records(path) -> list:
    """The records of an offline W&B run file (`run-*.wandb`: what `wandb sync` uploads): a 7-byte header, then a
    LevelDB-style log of 32 KiB blocks whose chunks (4-byte CRC, 2-byte length, 1-byte type: full, first, middle,
    last) carry serialised `Record` protos."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    out, pos, block, parts = [], 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos: pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        parts += data[pos + 7: pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full or last: a whole record
            rec = pb.Record()
            rec.ParseFromString(parts)
            out.append(rec)
            parts = b""
    return out


def processes_of(marker: str, cwd=None) -> list[str]:
    """Live processes (zombies aside: they hold nothing) started with `marker` ("NAME=value") in their environment
    or, when given, running in the directory `cwd`: vLLM renames its EngineCore and Workers (setproctitle), which
    overwrites what /proc shows of their environment, but not their working directory. Each as "pid cmdline"."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            env = (proc / "environ").read_bytes().split(b"\0")
            here = cwd is not None and os.readlink(proc / "cwd") == str(cwd)
            if marker.encode() in env or here:
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found.append(f"{proc.name} {cmd[:120]}")
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def processes_after(marker: str, cwd=None, grace_s: float = 10.0) -> list[str]:
    """`processes_of` once the processes a run killed have had `grace_s` to go (a kill is delivered at once, but a
    process dies when the kernel next schedules it)."""
    t_end = time.monotonic() + grace_s
    while (left := processes_of(marker, cwd)) and time.monotonic() < t_end:
        time.sleep(0.2)
    return left
