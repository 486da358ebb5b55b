"""The one model loader of draftsmith: a name (sampling/names.py resolves it to a directory) to a frozen model in eval
mode at the dtype and on the device asked for. Loading only loads: choosing the precision by timing and installing
the CPU's kernels are steps of their own (sampling/runtime.py), which each command takes once.
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftsmith.sampling import precision
from draftsmith.sampling.errors import DraftsmithError
from draftsmith.sampling.feature import is_feature_dir
from draftsmith.sampling.names import resolve
from draftsmith.sampling.peers import load_feature
from draftsmith.sampling.pruned import trained_head

DTYPES = precision.DTYPES






























def load_model(name: str, dtype: str = "fp32", device: str = "cpu", trust_remote_code: bool = False,
               device_map: str | None = None):
    """A frozen causal LM in eval mode, at `dtype` (bf16, fp32 or fp16) on `device`: nothing is timed, nothing is
    installed (sampling/runtime.py takes those steps). `device_map` (e.g. "auto"): its layers spread over the
    visible GPUs, for a model no one device holds; its outputs come back on its inputs' device. A checkpoint whose
    config asks to run its own code (`auto_map`) is refused unless trust_remote_code. A draft trained with a pruned
    head comes with it."""
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise DraftsmithError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r} (auto: "
                              "draftsmith.sampling.runtime.prepared_model chooses by timing this machine)")
    path = resolve(name)
    if not is_feature_dir(path):  # a feature head is read by our own code: a peer's auto_map is never imported
        check_remote_code(path, trust_remote_code)
    check_weight_files(path)
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise DraftsmithError(f"{path} holds a config but no weights: a shape to plan for (plan=true), not a model "
                              "to load; point target.name at a checkpoint with its weights")
    if is_feature_dir(path):
        return check_finite(load_feature(path, DTYPES[dtype]).to(device).requires_grad_(False), path)
    placed = device_map or _straight_onto(device)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code,
                                                 **({"device_map": placed} if placed else {}))
    model = (model if placed else model.to(device)).eval().requires_grad_(False)
    check_finite(model, path)
    return trained_head(model, path)  # a draft trained with a pruned head runs with it


def _straight_onto(device) -> dict | None:
    """The device map that has transformers write each weight straight onto an accelerator as it reads it: a copy
    on the host first would need the whole model in host memory too (140 GB for a 70B target in bf16) and a second
    pass over it. None on the CPU (and on `meta`, which transformers does not map): loaded there, then moved."""
    dev = torch.device(device)
    return None if dev.type in ("cpu", "meta") else {"": str(dev)}


def check_remote_code(path: Path, allowed: bool) -> None:
    """A config with `auto_map` makes transformers import Python shipped with the checkpoint: never by default."""
    import json

    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise DraftsmithError(f"{path}/config.json is not readable JSON ({type(e).__name__}: {e})") from None
    if "auto_map" in cfg and not allowed:
        raise DraftsmithError(f"{path} asks to run its own Python code (auto_map in config.json); refused. If you "
                              "trust it, pass --trust-remote-code (training: target.trust_remote_code=true)")




def check_weight_files(path: Path) -> None:
    """Every safetensors file whole: its header parses and its tensors end where the file ends. A file cut short
    by a killed copy or download is named here instead of failing deep inside a loader."""
    import json
    import struct

    for f in sorted(Path(path).glob("*.safetensors")):
        size = f.stat().st_size
        try:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                if n > size - 8:
                    raise DraftsmithError(f"header of {n} bytes in a {size}-byte file")
                header = json.loads(fh.read(n))
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except (struct.error, ValueError, KeyError, TypeError, IndexError) as e:
            raise DraftsmithError(f"{f} is not a readable safetensors file ({e}); download or export it "
                                  "again") from None
        if 8 + n + end != size:
            raise DraftsmithError(f"{f} is truncated or damaged: its header describes {8 + n + end} bytes, the file "
                                  f"holds {size}; download or export it again")


def check_finite(model, path):
    """Refuse weights holding NaN or Inf (a diverged run, a damaged file): they would poison every p or q. A tensor
    on `meta` (the stand-in device of the tests) has no values to check."""
    for name, t in model.state_dict().items():
        if t.is_floating_point() and t.device.type != "meta" and not bool(torch.isfinite(t).all()):
            raise DraftsmithError(f"{path}: weight {name} holds NaN or Inf values; use an earlier checkpoint "
                                  "(or re-export) of this model")
    return model


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    path = resolve(name)
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # a damaged tokenizer.json fails inside tokenizers with a bare JSON or Rust error
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise DraftsmithError(f"{path}: the tokenizer files are not readable ({type(e).__name__}: {first}); "
                              "download or export the checkpoint again") from None


def tokenizer_mismatches(target_tok, draft_tok) -> list[str]:
    """What differs between two tokenizers that must tokenize identically (empty: they match)."""
    problems = []
    if target_tok.get_vocab() != draft_tok.get_vocab():
        problems.append("vocabularies differ")
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        a, b = getattr(draft_tok, attr, None), getattr(target_tok, attr, None)
        if a != b:
            problems.append(f"{attr} {a} != {b}")
    if getattr(target_tok, "chat_template", None) != getattr(draft_tok, "chat_template", None):
        problems.append("chat templates differ")
    return problems


def check_same_tokenizer(target_tok, draft_tok) -> None:
    """Draft and target must tokenize identically: same vocabulary, special tokens and chat template."""
    problems = tokenizer_mismatches(target_tok, draft_tok)
    if problems:
        raise DraftsmithError("draft and target tokenizers differ (" + "; ".join(problems) + "): "
                              "train the draft with the target's tokenizer")
