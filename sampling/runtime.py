"""What a command decides once per model before it runs it, each step explicit and in this order:

1. the precision (`choose_dtype`): as asked; on a GPU, bf16 where it has it; on a CPU for `auto`, measured: the
   target's teacher passes by the machine's probe, batch-1 decoding by timing the model itself (sampling/precision.py);
2. the load (sampling/load.py, which only loads);
3. the CPU's Linear kernels per shape (sampling/kernels.py), timed once per machine and cached.

The right dtype depends on the CPU and on the shape: bf16 is faster for decoding where the CPU has native bf16, and
far slower for any real matmul where it falls back to a reference GEMM (docs/design.md). What each step chose rides
on the model (`draftsmith_choices`), and the run record and the bundle's card print it (precision.run_info).
"""

from __future__ import annotations

import torch

from draftsmith.sampling import kernels, precision
from draftsmith.sampling.errors import DraftsmithError
from draftsmith.sampling.feature import is_feature_dir
from draftsmith.sampling.load import DTYPES, load_model
from draftsmith.sampling.machine import cache_home
from draftsmith.sampling.names import resolve

DTYPE_CHOICES = ["auto", *DTYPES]
DEFAULT_DTYPE = "auto"
ROLES = ("decode", "teacher")


def kernels_cache():
    return cache_home() / "kernels.json"


def choose_dtype(name: str, requested: str = DEFAULT_DTYPE, role: str = "decode", device: str = "cpu",
                 cuda: bool | None = None, trust_remote_code: bool = False):
    """(dtype name, how it was chosen: asked, gpu, fixed, probed or timed, the fp32 model timed or None). `decode`
    on a CPU times the model itself, in fp32 with its kernels installed (so bf16 is weighed against the fp32 that
    would run); that model is handed back for reuse when fp32 wins."""
    if requested not in DTYPE_CHOICES:
        raise DraftsmithError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {requested!r}")
    if role not in ROLES:
        raise DraftsmithError(f"role must be decode or teacher, got {role!r}")
    cuda = str(device).startswith("cuda") if cuda is None else cuda
    if requested != "auto":
        return requested, "asked", None
    if cuda:
        return precision.cuda_dtype(), "gpu", None
    if is_feature_dir(resolve(name)):  # one layer: its cost is per-call overhead, not arithmetic
        return "fp32", "fixed", None
    if role == "teacher":
        return precision.resolve("auto", "teacher"), "probed", None
    model = load_model(name, "fp32", trust_remote_code=trust_remote_code)
    kernels.install(model, cache=kernels_cache())
    chosen = precision.decode_dtype(model)
    # not cast when bf16 wins: `.to(bf16)` would also cast buffers (RoPE's inv_freq) that from_pretrained keeps in
    # fp32, and the model would differ from the one a user loads with dtype=bf16; it is loaded again
    return chosen, "timed", model if chosen == "fp32" else None


def prepared_model(name: str, dtype: str = DEFAULT_DTYPE, role: str = "decode", device: str = "cpu",
                   trust_remote_code: bool = False, device_map: str | None = None):
    """The model a command runs: its precision chosen, loaded, its CPU kernels installed (a feature head takes
    none); `model.draftsmith_choices` says what each step chose."""
    cuda = str(device).startswith("cuda") or (device_map is not None and torch.cuda.is_available())
    chosen, how, model = choose_dtype(name, dtype, role, device, cuda, trust_remote_code)
    if model is None:
        model = load_model(name, chosen, device, trust_remote_code=trust_remote_code, device_map=device_map)
    if how == "asked" and not cuda:
        precision.check_choice(chosen, role, model)  # one warning line where this machine measured it slow
    table = {} if is_feature_dir(resolve(name)) else kernels.install(model, cache=kernels_cache())
    model.draftsmith_choices = {"dtype": chosen, "dtype_by": how, "kernels": dict(table)}
    return model
