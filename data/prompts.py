"""Generation prompts for a run: the prompts file or corpus openings, through the chat template when asked."""

from __future__ import annotations

import torch

from draftsmith.sampling.errors import DraftsmithError
from draftsmith.sampling.prompts import encode_prompts, load_prompts, user_turn


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
            rows = load_prompts(str(cfg.data.prompts))
        except (ValueError, OSError) as e:
            raise DraftsmithError(f"data.prompts: {e}") from None
        texts = [r["prompt"] for r in rows]
        share = float(cfg.data.get("chat_prompts", 0) or 0)
        if share:  # raw prompts (data.chat_template is refused beside it: train/data.py check_data)
            texts = with_chat_turns(texts, [r["domain"] for r in rows], share, tokenizer, str(cfg.data.prompts))
    else:
        texts = [tokenizer.decode(row, skip_special_tokens=True) for row in openings]
    if cfg.data.chat_template:
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                               add_generation_prompt=True) for t in texts]
    return texts


def with_chat_turns(texts: list[str], domains: list[str], share: float, tokenizer, where: str = "data.prompts",
                    max_tokens: int = 96) -> list[str]:
    """`data.chat_prompts`: that share of the English prompts (every 1/share-th, so any prefix a time box reaches
    holds the share) replaced by first user turns of ShareGPT's training split, each through the target's chat
    template as the chat set renders its prompts (`user_turn`), in the file's order; distinct turns of 4 to
    `max_tokens` tokens. The held-out split (the chat set's conversations and data=chat's validation) is never read.
    Code prompts stay as they are: giving them up cost the draft on code at equal time (docs/results.md)."""
    from draftsmith.data.conversations import read_conversations  # ShareGPT: read only where the switch is on

    english = [i for i, d in enumerate(domains) if d == "english"]
    slots = [i for n, i in enumerate(english, 1) if int(n * share) > int((n - 1) * share)]
    if not slots:
        raise DraftsmithError(f"data.chat_prompts={share} replaces English prompts (domain 'english'), and {where} "
                              "has none: add a `domain` field, or set data.chat_prompts=0")
    turns, seen = [], set()
    for conv in read_conversations("sharegpt", split="train", quiet=True):
        first = next((m for m in conv.messages if m["role"] != "system"), None)
        if first is None or first["role"] != "user":
            continue
        text = first["content"].strip()
        if text in seen or not 4 <= len(tokenizer(text, add_special_tokens=False)["input_ids"]) <= max_tokens:
            continue
        seen.add(text)
        turns.append(user_turn(tokenizer, text))
        if len(turns) == len(slots):
            break
    if len(turns) < len(slots):
        raise DraftsmithError(f"data.chat_prompts={share} asks for {len(slots)} ShareGPT turns and its training split "
                              f"holds {len(turns)} of 4-{max_tokens} tokens: lower data.chat_prompts")
    out = list(texts)
    for i, turn in zip(slots, turns):
        out[i] = turn
    return out


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


