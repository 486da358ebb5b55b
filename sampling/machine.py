"""Where draftsmith keeps its files and what machine it runs on: the one home for both, so that precision,
kernels and model loading read them without importing each other.

Every figure names the machine it was measured on (`machine()`); every cached verdict is keyed by it
(`machine_key()`); every file that another process may read while it is written goes through `atomic_path`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import time
from pathlib import Path

import torch


def device_of(model) -> torch.device:
    """Where a model's weights live: every tensor, generator and timer that feeds it takes its device from here
    (a model with no weights, such as a test's fixed distribution, says so with a `device` attribute or is on the
    CPU)."""
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device(getattr(model, "device", "cpu"))


def default_device() -> str:
    """Where a command measures and samples unless told: the GPU where there is one (a bundle's c and v(K) are
    figures of the device it will serve on), else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def seeded(device, seed: int) -> torch.Generator:
    """A generator seeded `seed` on `device`, where the model draws: its draws cost no copy. A device with no
    generator of its own (`meta`, the tests' stand-in accelerator) draws on the host (`probs.uniform` moves each
    draw there)."""
    dev = torch.device(device)
    return torch.Generator(device="cpu" if dev.type == "meta" else dev).manual_seed(seed)


def now(device=None) -> float:
    """perf_counter after the device has finished its queued work: CUDA runs asynchronously, so an unsynchronised
    timer measures the launch of a kernel, not its run, and c and v(K) would be wrong on a GPU."""
    if device is not None and (device.type if isinstance(device, torch.device) else torch.device(device).type) \
            == "cuda":  # the sampler's loop passes a torch.device: no parsing per step
        torch.cuda.synchronize(device)
    return time.perf_counter()


def reads_are_free(device) -> bool:
    """True where reading a tensor's values from the host costs no wait: on the CPU the host is the device. On an
    accelerator every read (`.item()`, `.tolist()`, `bool()`, `nonzero`) waits for the device's queue to drain, so
    the sampler's loops read once per loop there and branch on nothing else; on the CPU a few loops branch on values
    to skip work (top-p over a few candidates instead of a sort of the whole vocabulary). Tests set it False to run
    the accelerator's paths on the CPU, with real numbers."""
    return torch.device(device).type == "cpu"


class Timeline:
    """Marks on a device's own clock that never make the host wait: on CUDA each mark is an event recorded in the
    stream (a synchronising timer would stall the queue at every mark, and the loop's overlap of host and device
    work with it), resolved once at the end; elsewhere `perf_counter`. Spans are named (`draft`, `target`, ...)."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.marks: list = []
        self.spans: dict[str, list[tuple[int, int]]] = {}
        self.start = self.mark()

    def mark(self) -> int:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())
        return len(self.marks) - 1

    def span(self, name: str, start: int) -> int:
        """Closes the span `name` opened at mark `start`; returns its end mark."""
        end = self.mark()
        self.spans.setdefault(name, []).append((start, end))
        return end

    def seconds(self) -> list[float]:
        """Every mark's time since the first, in seconds (on CUDA: one wait, for the last event)."""
        if self.cuda:
            self.marks[-1].synchronize()
            return [self.marks[0].elapsed_time(e) / 1e3 for e in self.marks]
        return [m - self.marks[0] for m in self.marks]

    def total(self, name: str, at: list[float]) -> float:
        return sum(at[b] - at[a] for a, b in self.spans.get(name, ()))


def cache_home() -> Path:
    """$DRAFTSMITH_HOME, default ~/.cache/draftsmith: models, generated corpora, verdicts, engines."""
    return Path(os.environ.get("DRAFTSMITH_HOME", Path.home() / ".cache" / "draftsmith"))


@contextlib.contextmanager
def atomic_path(path, tag: str = "partial"):
    """A temporary name beside `path` to write to; renamed onto `path` when the block ends without an error, removed
    otherwise. A reader (or a process killed mid-write) sees the old file or the new one, never a torn one. The
    name carries the pid: two processes may write the same file at once, and the last rename wins whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{tag}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_text(path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None  # absent or damaged: measured again


def write_json(path: Path, v: dict) -> None:
    write_text(path, json.dumps(v, indent=2))


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_flags() -> str:
    """The flags that decide bf16 speed (a VM may report only 'AMD EPYC' as its model)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                return " ".join(sorted(f for f in flags if f.startswith(("avx512_bf16", "amx", "avx512f", "avx2"))))
    except OSError:
        pass
    return ""


def machine() -> dict:
    """What a speed figure was measured on: goes into every benchmark, report and card."""
    return {
        "cpu": _cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_flags": _cpu_flags(),
        "native_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def machine_key(m: dict | None = None) -> str:
    m = m or machine()
    ident = [m["cpu"], m["cpu_capability"], m["cpu_flags"], m["native_bf16"], m["threads"], m["torch"]]
    return hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:16]


def stream_into(h, path: Path):
    """`h` (a hashlib object) updated with the file's bytes, read in 1 MiB blocks."""
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h


def files_sha256(folder: Path, names) -> str:
    """One digest of the named files that exist in `folder`, each as its name then its bytes (streamed): the
    identity of a target the bundle points at, and the key of an engine's converted copy of a model."""
    h = hashlib.sha256()
    for n in names:
        if (Path(folder) / n).is_file():
            h.update(n.encode())
            stream_into(h, Path(folder) / n)
    return h.hexdigest()


def wandb_mode(mode: str) -> str:
    """auto: online only when a key is configured (env or netrc); offline otherwise, so it never blocks."""
    if mode != "auto":
        return mode
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = Path.home() / ".netrc"
    if netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore"):
        return "online"
    return "offline"
