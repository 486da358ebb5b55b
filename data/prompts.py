"""Generation prompts for a run: the prompts file or corpus openings, through the chat template when asked."""

from __future__ import annotations

import torch

from draftsmith.sampling.errors import DraftsmithError
from draftsmith.sampling.prompts import encode_prompts, load_prompts


def validation_prompts(blocks: dict, n: int, prompt_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Openings of held-out blocks (never trained on) as sampler prompts: (n, prompt_tokens) ids and mask."""
    val = blocks["val"]
    n = min(n, len(val))
    idx = torch.linspace(0, len(val) - 1, n).long()
    ids = val[idx, :prompt_tokens].clone()
    return ids, torch.ones_like(ids)


def prompt_texts(cfg, tokenizer, openings: torch.Tensor | None = None, use_file: bool = True) -> list[str]:
    """Generation prompts: `data.prompts` (a JSONL with a `prompt` field) or decoded corpus openings; wrapped in the
    target's chat template when `data.chat_template` (an Instruct target is deployed that way)."""
    if cfg.data.prompts and use_file:
        try:
            texts = [r["prompt"] for r in load_prompts(str(cfg.data.prompts))]
        except (ValueError, OSError) as e:
            raise DraftsmithError(f"data.prompts: {e}") from None
    else:
        texts = [tokenizer.decode(row, skip_special_tokens=True) for row in openings]
    if cfg.data.chat_template:
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                               add_generation_prompt=True) for t in texts]
    return texts


def prompt_tensor(texts: list[str], tokenizer, max_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded (N, <= max_tokens) ids and mask of text that already holds its special tokens."""
    try:
        return encode_prompts(tokenizer, texts, max_tokens, special_tokens=False)
    except ValueError as e:
        raise DraftsmithError(f"no usable generation prompt: {e}") from None


def split_prompts(cfg, tokenizer) -> tuple[list[str] | None, list[str] | None]:
    """`data.prompts` as (training prompts, held-out prompts for val/alpha_on_target): every k-th prompt is held
    out and never trained on. (None, None) without a prompts file."""
    if not cfg.data.prompts:
        return None, None
    texts = prompt_texts(cfg, tokenizer)
    if len(texts) < 4:
        return texts, None
    n = min(cfg.sampler.on_target_prompts, len(texts) // 2)
    held = set(torch.linspace(0, len(texts) - 1, n).long().tolist())
    return [t for i, t in enumerate(texts) if i not in held], [t for i, t in enumerate(texts) if i in held]


def on_target_prompts(cfg, tokenizer, blocks: dict, held_out: list[str] | None):
    """Prompts the target continues once for val/alpha_on_target: the prompts file's held-out ones, else held-out
    corpus openings (through the chat template when asked). None when the metric is off."""
    s = cfg.sampler
    if not s.on_target_tokens:
        return None
    if held_out is not None:
        return prompt_tensor(held_out, tokenizer, s.prompt_tokens + 64)
    openings, ones = validation_prompts(blocks, s.on_target_prompts, s.prompt_tokens)
    if cfg.data.chat_template:
        return prompt_tensor(prompt_texts(cfg, tokenizer, openings, use_file=False), tokenizer, s.prompt_tokens + 64)
    return openings, ones


