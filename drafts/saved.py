"""A run's drafts as files: the best draft as a Hugging Face checkpoint (safetensors, config, tokenizer), and the
weights of a training checkpoint read back. Imports no Lightning: exporting a finished run and judging engines need
no trainer."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from draftsmith.sampling.machine import device_of
from draftsmith.sampling.pruned import HEAD_TOKENS, TOKEN_COUNTS


def checkpoint_state(path) -> dict[str, torch.Tensor]:
    """The module's state dict from a training checkpoint: a Lightning file (read with weights_only=True), or a
    DeepSpeed ZeRO directory, its shards consolidated to fp32 by DeepSpeed's own reader (files this run wrote)."""
    path = Path(path)
    if path.is_dir():
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(path))
        return {k.removeprefix("_forward_module."): v for k, v in state.items()}
    return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]


def draft_from_checkpoint(draft, ckpt_path: str, rebuild: bool = False, device=None):
    """A copy of `draft` with the weights of a training checkpoint (`checkpoint_state`: a Lightning file or a
    DeepSpeed directory), on `device` (default: the draft's); a draft whose parameters ZeRO-3 or FSDP split
    (`rebuild`) is rebuilt from its config there (its shards' device says nothing of where it will run)."""
    state = checkpoint_state(ckpt_path)
    if rebuild:
        with torch.device(device or "cpu"):
            out = type(draft)(draft.config)
    else:
        out = copy.deepcopy(draft).to(device or device_of(draft))
    out.load_state_dict({k.removeprefix("draft."): v for k, v in state.items() if k.startswith("draft.")})
    return out.eval()


def save_draft(draft, tokenizer, path: Path, token_counts: torch.Tensor | None = None,
               head_tokens: torch.Tensor | None = None) -> Path:
    """safetensors + config + tokenizer + generation config: loadable by AutoModelForCausalLM as is. The corpus'
    token counts ride along (`TOKEN_COUNTS`) for an exact pruned draft head (sampling/pruned.py), and the head's
    tokens (`HEAD_TOKENS`) of a draft trained with a pruned head, which `load_model` then runs with it."""
    from safetensors.torch import save_file

    draft.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    for name, key, tensor in ((TOKEN_COUNTS, "counts", token_counts), (HEAD_TOKENS, "token_ids", head_tokens)):
        if tensor is not None:
            (path / name).parent.mkdir(exist_ok=True)
            save_file({key: tensor.detach().cpu().contiguous()}, path / name)
    return path
