"""Precision chosen per machine and per role, by measuring, never by assumption.

On a CPU with native bf16 (AVX-512 BF16, AMX) bf16 is the fast choice everywhere. On an AVX2-only CPU a bf16
matrix multiply falls back to PyTorch's reference GEMM and runs 50-70x slower than fp32, while a 1-token decoding
pass over a model larger than the cache is still faster in bf16 (half the bytes to stream). So the answer depends
on the machine and on the shape, and there are three roles:

- `train`:   the draft's forward + backward over a training batch (Lightning `trainer.precision`);
- `teacher`: forward passes over many tokens: the target's teacher pass, prefill, batched sampling;
- `decode`:  batch-1 decoding: a 1-token pass and a (K+1)-token verification pass.

`probe()` times the train and teacher shapes in fp32 and bf16 (well under a second: a slow bf16 path is caught on
a small shape first) and `resolve()` turns `auto` into a dtype; `decode_dtype()` times the model itself (a 1-token
and a (K+1)-token pass), once per model. Verdicts are cached under $DRAFTSMITH_HOME/precision, keyed by CPU model
and flags, torch version and thread count. On CUDA nothing is probed: bf16 where the GPU supports it, else fp16.
"""

from __future__ import annotations

import copy
import hashlib
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from draftsmith.sampling.cost import Stepper
from draftsmith.sampling.errors import DraftsmithError
from draftsmith.sampling.machine import cache_home, device_of, machine, machine_key, read_json, write_json

ROLES = ("train", "teacher", "decode")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
# An explicit bf16 choice this much slower than fp32 on the machine at hand is honoured, with a warning.
WARN_RATIO = 1.5
# Slower than this on a small matmul means no native bf16 GEMM: no need to time the full-size shapes.
_SLOW_PATH_RATIO = 8.0


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dtype]


def run_info(**models) -> dict:
    """What a speed figure ran on: the machine, the device the models ran on (the first model's; a GPU box's
    figures may still be the CPU's) and each model's precision (`target=..., draft=...`)."""
    first = next(iter(models.values()))
    info = {"machine": machine(), "device": device_name(device_of(first)),
            "dtype": {name: dtype_name(m.dtype) for name, m in models.items()}}
    # how each precision was chosen (asked, gpu, fixed, probed, timed) and the CPU kernels installed, where the
    # command's own steps (sampling/runtime.py) recorded them on the model
    chosen = {name: m.draftsmith_choices for name, m in models.items() if hasattr(m, "draftsmith_choices")}
    if chosen:
        info["chosen"] = {name: {"dtype_by": c["dtype_by"], "kernels": {str(r): k for r, k in c["kernels"].items()}}
                          for name, c in chosen.items()}
    return info


def device_name(device) -> str:
    """'cuda:0 (NVIDIA H200)', or 'cpu' (the machine line names the CPU)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return f"{dev} ({torch.cuda.get_device_name(dev)})"
    return dev.type


def describe_run(info: dict) -> str:
    """One line for a report: 'AMD EPYC, AVX2, no native bf16, 2 threads, torch 2.13.0+cpu; target fp32, ...'
    (on a GPU: the GPU's name)."""
    m = info["machine"]
    device = info.get("device", "cuda" if m["cuda"] else "cpu")  # records made before the device was kept
    where = device if device.startswith("cuda") else f"{m['cpu']}, {_describe(m)}"
    chosen = info.get("chosen", {})

    def how(name):  # "(timed)", "(timed; kernels 1:onednn 5:padded)": what the command's steps chose
        c = chosen.get(name)
        if not c:
            return ""
        kern = " ".join(f"{r}:{k}" for r, k in c["kernels"].items() if k != "linear")
        return f" ({c['dtype_by']}{'; kernels ' + kern if kern else ''})"

    return f"{where}, torch {m['torch']}; " + ", ".join(f"{k} {v}{how(k)}" for k, v in info["dtype"].items())


def _median_ms(fn, reps: int, budget_s: float) -> float:
    fn()  # warm-up (first-touch of pages, kernel selection)
    times = []
    t_end = time.perf_counter() + budget_s
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
        if time.perf_counter() > t_end:
            break
    return 1e3 * statistics.median(times)


def _train_step(dtype, m=256, d=576, h=1536):
    """An MLP forward + backward at a training-sized shape, under autocast as Lightning's bf16-mixed runs it."""
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(m, d, generator=g, device="cpu")
    w1 = (torch.randn(h, d, generator=g, device="cpu") * d ** -0.5).requires_grad_()
    w2 = (torch.randn(d, h, generator=g, device="cpu") * h ** -0.5).requires_grad_()

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            y = F.linear(F.silu(F.linear(x, w1)), w2)
        y.float().square().mean().backward()
        w1.grad = w2.grad = None

    return step


def _matmul(dtype, m, k=512, n=512):
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(m, k, generator=g, device="cpu").to(dtype)
    b = torch.randn(k, n, generator=g, device="cpu").to(dtype)
    return lambda: a @ b


def _forward(dtype, m, d=576, h=1536):
    """A transformer MLP block's forward over m rows (a teacher pass or a prefill is made of these)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(m, d, generator=g, device="cpu").to(dtype)
    up = (torch.randn(h, d, generator=g, device="cpu") * d ** -0.5).to(dtype)
    down = (torch.randn(d, h, generator=g, device="cpu") * h ** -0.5).to(dtype)

    @torch.inference_mode()
    def fwd():
        return F.linear(F.silu(F.linear(x, up)), down)

    return fwd


def probe() -> dict:
    """Time the `train` and `teacher` shapes in fp32 and bf16. Returns {"ms": {role: {dtype: ms}}, ...}."""
    t0 = time.perf_counter()
    # Screen: a 128x512x512 matmul shows at once whether bf16 GEMM is native (about as fast as fp32) or the
    # reference fallback (tens of times slower: docs/design.md, "Machines").
    screen = {n: _median_ms(_matmul(dt, 128), 3, 0.15) for n, dt in (("fp32", torch.float32),
                                                                       ("bf16", torch.bfloat16))}
    slow_path = screen["bf16"] > _SLOW_PATH_RATIO * screen["fp32"]
    ms = {"screen": screen}
    for role, make in (("train", _train_step), ("teacher", lambda dt: _forward(dt, 512))):
        ms[role] = {"fp32": _median_ms(make(torch.float32), 5, 0.3)}
        # Timing the full shape on the fallback would take seconds; the screen's ratio is within ~30% of it
        # (measured 59x on the screen, 75x at 1020x576x1536) and the verdict is not close.
        ms[role]["bf16"] = (ms[role]["fp32"] * screen["bf16"] / screen["fp32"] if slow_path
                            else _median_ms(make(torch.bfloat16), 5, 0.3))
    return {"ms": ms, "bf16_gemm": "reference fallback" if slow_path else "native", "probe_s": time.perf_counter() - t0}


def decide(ms: dict, roles=("train", "teacher")) -> dict:
    """{role: "fp32" | "bf16"} from timings, and one phrase per role saying why."""
    out, why = {}, {}
    for role in roles:
        r = ms[role]["bf16"] / ms[role]["fp32"]
        out[role] = "bf16" if r < 1 else "fp32"
        why[role] = f"bf16 {r:.1f}x slower than fp32" if r >= 1 else f"bf16 {1 / r:.1f}x faster than fp32"
    return {"dtype": out, "why": why}


def _describe(m: dict) -> str:
    kind = "native bf16" if m["native_bf16"] else "no native bf16"
    return f"{m['cpu_capability']}, {kind}, {m['threads']} threads"


def _cache_path(key: str) -> Path:
    return cache_home() / "precision" / f"{key}.json"


def verdict(refresh: bool = False, quiet: bool = False) -> dict:
    """This machine's verdict for `train` and `teacher`, probing once if none is cached for its key."""
    m = machine()
    key = machine_key(m)
    path = _cache_path(key)
    v = None if refresh else read_json(path)
    if v is not None and "dtype" in v:
        return v
    res = probe()
    v = {"key": key, "machine": m, **res, **decide(res["ms"]), "models": (v or {}).get("models", {})}
    if res["bf16_gemm"] != "native":
        r = res["ms"]["screen"]["bf16"] / res["ms"]["screen"]["fp32"]
        v["why"] = {role: f"bf16 matmul {r:.0f}x slower than fp32: no native bf16 GEMM" for role in v["why"]}
    write_json(path, v)
    if not quiet:
        d, w = v["dtype"], v["why"]
        print(f"draftsmith: precision probe ({v['probe_s']:.2f} s) on this CPU ({_describe(m)}): "
              f"training in {d['train']} ({w['train']}), teacher passes in {d['teacher']} ({w['teacher']})",
              file=sys.stderr)
    return v


def model_id(model) -> str:
    """A model's identity for the decode verdict: its config (weights do not change the timings)."""
    return hashlib.sha256(model.config.to_json_string(use_diff=False).encode()).hexdigest()[:16]


@torch.inference_mode()
def _decode_ms(model, k: int, context: int = 128, reps: int = 3) -> float:
    """A 1-token pass plus a (K+1)-token pass over a warm KV cache: one ArS step and one SpS verification."""
    g = torch.Generator(device="cpu").manual_seed(0)
    step = Stepper(model, torch.randint(0, model.config.vocab_size, (1, context), generator=g, device="cpu"))
    return _median_ms(lambda: step(1), reps, 0.5) + _median_ms(lambda: step(k + 1), reps, 0.5)


def decode_dtype(model, k: int = 4, quiet: bool = False) -> str:
    """The faster dtype for batch-1 decoding of this model on this machine, measured on the model itself (an fp32
    model is timed, then a bf16 copy). Small synthetic layers mislead here: they sit in cache and miss the
    (K+1)-token pass's slow bf16 paths (on an AVX2 CPU a skeleton ranked bf16 first, while the demo target itself
    decodes faster in fp32)."""
    v = verdict(quiet=quiet)
    mid = model_id(model)
    hit = v.get("models", {}).get(mid)
    kernels = any(hasattr(m, "kernels") for m in model.modules())  # sampling/kernels.py: fp32 is faster with them
    if hit and hit.get("k") == k and hit.get("kernels", False) == kernels:
        return hit["dtype"]
    if model.dtype != torch.float32:
        raise DraftsmithError(f"decode_dtype times an fp32 model and a bf16 copy of it; got a {model.dtype} model")
    t0 = time.perf_counter()
    ms = {"fp32": _decode_ms(model, k)}
    ms["bf16"] = _decode_ms(copy.deepcopy(model).to(torch.bfloat16), k)
    d = decide({"decode": ms}, roles=("decode",))
    v.setdefault("models", {})[mid] = {"k": k, "kernels": kernels, "ms": ms, "dtype": d["dtype"]["decode"],
                                       "why": d["why"]["decode"], "name": getattr(model.config, "_name_or_path", ""),
                                       "probe_s": time.perf_counter() - t0}
    write_json(_cache_path(v["key"]), v)
    if not quiet:
        print(f"draftsmith: decoding in {d['dtype']['decode']} ({d['why']['decode']} for a 1-token + {k + 1}-token "
              f"pass of this model on this CPU, {_describe(v['machine'])})", file=sys.stderr)
    return d["dtype"]["decode"]


def cuda_dtype() -> str:
    return "bf16" if torch.cuda.is_bf16_supported() else "fp16"


def _is_cuda(device) -> bool:
    return str(device).startswith("cuda")


def check_choice(requested: str, role: str, model=None) -> None:
    """An explicit choice is honoured; one warning line when this machine's measurement says bf16 is much slower.
    Never probes for it (a cached verdict or none)."""
    if requested != "bf16":
        return
    v = read_json(_cache_path(machine_key()))
    if not v:
        return
    ms = v.get("ms", {}).get(role) if role != "decode" else v.get("models", {}).get(model_id(model), {}).get("ms")
    if ms and ms["bf16"] > WARN_RATIO * ms["fp32"]:
        warnings.warn(f"bf16 is {ms['bf16'] / ms['fp32']:.1f}x slower than fp32 for {role} on this CPU "
                      f"({_describe(v['machine'])}); kept as asked (dtype=auto lets draftsmith choose)", stacklevel=3)


def resolve(requested: str, role: str, device: str = "cpu") -> str:
    """`auto` -> the measured dtype name for `train` or `teacher` on this machine; explicit names are kept.
    (`decode` needs the model: see `decode_dtype`.)"""
    if role not in ("train", "teacher"):
        raise DraftsmithError(f"resolve() takes role train or teacher, got {role!r} (decode: decode_dtype(model))")
    if requested != "auto" and requested not in DTYPES:
        raise DraftsmithError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {requested!r}")
    if requested != "auto":
        if not _is_cuda(device):
            check_choice(requested, role)
        return requested
    if _is_cuda(device):
        return cuda_dtype()
    return verdict()["dtype"][role]


def trainer_precision(requested: str, accelerator: str = "cpu") -> str:
    """Lightning's `trainer.precision` for `auto`: bf16-mixed where bf16 training is fast here, else 32-true
    (16-mixed on a GPU without bf16)."""
    gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    if requested != "auto":
        if str(requested).startswith("bf16") and not gpu:
            check_choice("bf16", "train")
        return requested
    if gpu:
        return "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"
    return "bf16-mixed" if verdict()["dtype"]["train"] == "bf16" else "32-true"
