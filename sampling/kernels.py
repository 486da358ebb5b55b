"""Linear layers at decoding's few rows, computed the way this CPU does it fastest, chosen by timing at load.

Why: on a CPU, decoding one token or verifying K+1 is a product of a few rows with every weight matrix, read cold
from memory. The default `F.linear` (x @ W.T through MKL) is far from the best kernel there: on an AVX2 CPU in fp32
the demo target's matrix products made scoring 2 tokens cost nearly twice scoring one (v(1), docs/design.md; figures
in docs/results.md), which caps every draft's speed-up. The same products as W @ x.T (MKL's plain layout, no
repacking of the weight) cost about half at 2 to 4 rows; at 3 rows padding to 4 pays; at 1 row oneDNN sometimes
wins.

Other CPUs and MKL builds rank these differently, and products timed alone rank differently from the same products
in a forward pass, so nothing is assumed: `install` times whole forward passes of the model at each row count under
each kernel and keeps F.linear unless beaten by 10%. Beyond 64 rows (prefill, training) F.linear is kept: the
products are compute-bound there and the kernels tie. The price: where oneDNN is chosen, it keeps a packed copy of
those weights (as much memory again for them). Results differ from F.linear's only by float rounding
(another summation order), as a different number of rows already does.
"""

import os
import types
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.sampling.cost import Stepper
from draftsmith.sampling.machine import machine_key, read_json, write_json

FEW_ROWS = 64  # above this, F.linear (compute-bound: nothing to gain, measured)
MIN_BYTES = 1 << 20  # matrices this small stay in cache and gain nothing measurable (the tiny test models)


_PACKED = {}  # id(weight) -> (its data_ptr and _version when packed, oneDNN's copy); dropped with the weight


def _onednn(x2, weight):
    # oneDNN multiplies by its own copy of the weight; the copy is remade if the weight changed in place
    # (`_version`), so an updated model never multiplies by stale numbers
    key, entry = (weight.data_ptr(), weight._version), _PACKED.get(id(weight))
    if entry is None:
        weakref.finalize(weight, _PACKED.pop, id(weight), None)
    if entry is None or entry[0] != key:
        entry = _PACKED[id(weight)] = (key, weight.detach().to_mkldnn())
    return torch._C._nn.mkldnn_linear(x2.to_mkldnn(), entry[1], None).to_dense()


def _padded(x2, w):
    # MKL's plain-layout product runs fastest at a multiple of 4 rows (measured in the demo target: 3 rows padded
    # with a zero row to 4 took v(2) from 1.6 to 1.3); the zero rows' outputs are dropped
    n = x2.shape[0]
    if n % 4:
        x2 = torch.cat([x2, x2.new_zeros(4 - n % 4, x2.shape[1])])
    return (w @ x2.t()).t()[:n]


KERNELS = {
    "linear": F.linear,
    "transposed": lambda x2, w: (w @ x2.t()).t(),  # MKL's plain layout: no repacking of the weight
    "padded": _padded,
    "onednn": _onednn,
}


ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 16)  # each timed: MKL's ranking changes from one row count to the next; 16 stands
# for 9..FEW_ROWS (batched decoding)


def calibrate(step, table: dict[int, str], rows=ROWS, reps: int = 3) -> dict[int, str]:
    """Fill `table` ({rows: kernel}, read by every patched layer) with the kernel under which `step(rows)` (the
    seconds of a whole forward pass: products timed alone rank differently, their operands warm in cache) is least;
    the kernels interleaved so that load on the machine hits all alike; F.linear unless beaten by 10%."""
    names = [n for n in KERNELS if n != "onednn" or torch.backends.mkldnn.is_available()]
    with torch.inference_mode():
        for m in rows:
            times = {n: [] for n in names}
            for _ in range(reps + 1):  # the first round warms up (and makes oneDNN's copies)
                for n in names:
                    table[m] = n
                    times[n].append(step(m))
            best = {n: min(ts[1:]) for n, ts in times.items()}
            fastest = min(best, key=best.get)
            table[m] = fastest if best[fastest] < 0.9 * best["linear"] else "linear"
    _PACKED.clear()  # oneDNN's copies are made again on first use, only where it was chosen
    return table


def _fast_forward(self: nn.Linear, x):
    """nn.Linear.forward with the calibrated kernels (bound to each module, so a deepcopy rebinds to the copy)."""
    w, b = self.weight, self.bias
    x2 = x.reshape(-1, x.shape[-1])
    rows = x2.shape[0]
    if (rows > FEW_ROWS or w.dtype != torch.float32 or w.device.type != "cpu"  # calibrated for this CPU; a model
            # moved to a GPU after its load (Lightning moves the target with the module) runs F.linear there
            or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
        return F.linear(x, w, b)  # the calibrated kernels are for fp32 inference; oneDNN's has no backward
    kernel = self.kernels[rows if rows <= 8 else 16]
    if kernel == "onednn" and torch.compiler.is_compiling():
        kernel = "transposed"  # its packed copy is kept outside any graph; compiled, the plain layout stands in
    y = KERNELS[kernel](x2, w)
    if b is not None:
        y = y + b
    return y.reshape(*x.shape[:-1], w.shape[0])


def install(model: nn.Module, step=None, force: dict[int, str] | None = None, cache: Path | None = None) -> dict:
    """Give every fp32 CPU nn.Linear of `model` one table of kernels ({rows: kernel}), timed by calibrate() with
    `step` (default: a forward of `rows` new tokens over a warm KV cache, as sampling/cost.py times them) or read
    from `cache`, a JSON file that keeps the table per CPU, torch, threads and model shapes, so only the first
    load on a machine pays the timing (about 10 s for SmolLM2-135M). `force` (a table) skips both (tests).
    The patch is a forward on each module: weights, tying and saving are untouched. Returns the table, or {}
    where nothing applies or F.linear won everywhere. DRAFTSMITH_KERNELS=off keeps F.linear (to measure it)."""
    if os.environ.get("DRAFTSMITH_KERNELS", "on") == "off" and not force:
        return {}
    modules = [m for m in model.modules() if isinstance(m, nn.Linear) and m.weight.device.type == "cpu"
               and m.weight.dtype == torch.float32 and (force or m.weight.numel() * 4 >= MIN_BYTES)]
    if not modules:
        return {}
    table = dict(force) if force else dict.fromkeys(ROWS, "linear")
    for m in modules:
        m.kernels = table
        m.forward = types.MethodType(_fast_forward, m)
    if not force:
        known, key = (read_json(cache) if cache else None) or {}, _choice_key(modules)
        if key in known:
            table.update({int(r): n for r, n in known[key].items()})
        else:
            if step is None:
                step = Stepper(model, torch.randint(0, model.config.vocab_size, (1, 32)))  # cpu: CPU models only
            calibrate(step, table)
            known[key] = table
            if cache:
                try:
                    write_json(cache, known)
                except OSError:  # a read-only home: the table is simply timed again next time
                    pass
    if set(table.values()) == {"linear"}:
        for m in modules:
            del m.forward
        return {}
    return table


def _choice_key(modules) -> str:
    """This machine (precision.machine_key: CPU, flags, threads, torch) and the model's linear shapes."""
    shapes = ",".join(f"{o}x{i}" for o, i in sorted({tuple(m.weight.shape) for m in modules}))
    return f"{machine_key()} | {len(modules)} of {shapes}"
