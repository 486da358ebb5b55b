"""Prompt sets and their encoding: the shipped sets (`recipes/prompts/*.jsonl`, package data) or any JSONL with a
`prompt` field, and the one left-padded encoder that every batched decode (benches, evaluation, corpus sampling,
deploy checks) uses."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from draftsmith.sampling.errors import DraftsmithError

# beside this package in the checkout and in the installed wheel alike (draftsmith/recipes/prompts)
PROMPTS_DIR = Path(__file__).resolve().parent.parent / "recipes" / "prompts"


def load_prompts(name_or_path: str, n: int | None = None) -> list[dict]:
    """A shipped prompt set (`code`, `english`) or any JSONL file with a `prompt` field."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PROMPTS_DIR / f"{name_or_path}.jsonl"
    if not path.is_file():
        shipped = ", ".join(p.stem for p in sorted(PROMPTS_DIR.glob("*.jsonl")))
        raise DraftsmithError(f"prompt set not found: {name_or_path} (shipped: {shipped}, or a .jsonl path)")
    rows = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise DraftsmithError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DraftsmithError(f"{path}:{i + 1}: not a JSON object ({e.msg})") from None
        if not isinstance(row, dict):
            raise DraftsmithError(f"{path}:{i + 1}: not a JSON object")
        if not isinstance(row.get("prompt"), str) or not row["prompt"]:
            raise DraftsmithError(f"{path}:{i + 1}: each line needs a non-empty string field 'prompt'")
        rows.append({"prompt": row["prompt"], "domain": row.get("domain", path.stem)})
    if not rows:
        raise DraftsmithError(f"{path} holds no usable prompt (JSONL, one object with a 'prompt' string per line)")
    return rows[:n] if n else rows


def user_turn(tokenizer, text: str, enable_thinking: bool | None = None) -> str:
    """`text` as one user turn through the tokenizer's chat template, with the generation prompt: how a draft trained
    with data=chat met its prompts (data/chat.py renders the same way). Encode it with special_tokens=False: the
    template writes the BOS itself, and a tokenizer that adds one too would give the prompt two. `enable_thinking`
    None leaves the template's default."""
    if not getattr(tokenizer, "chat_template", None):
        raise DraftsmithError("the target's tokenizer has no chat template to render the prompt as a user turn with "
                              "(generate without --chat)")
    kw = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True, **kw)


def encode_prompts(tokenizer, texts: list[str], max_tokens: int | None = None,
                   special_tokens: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded (N, width) ids and attention mask, so prompts of different lengths decode as one batch. A prompt
    longer than max_tokens keeps its last max_tokens tokens (the part a continuation depends on most); prompts
    that tokenize to nothing are dropped. special_tokens=False for text that already holds them (a chat template).
    The tokenizer is not changed (its padding side and pad token are shared with every other user)."""
    rows = [ids[-max_tokens:] if max_tokens else ids
            for ids in tokenizer(texts, add_special_tokens=special_tokens)["input_ids"] if ids]
    if not rows:
        raise DraftsmithError("no usable prompt: every prompt tokenizes to nothing")
    width = max(len(r) for r in rows)
    pad = pad_id(tokenizer)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return ids, mask


def pad_id(tokenizer) -> int:
    """The id that fills padding: the tokenizer's pad token, else its EOS (many causal LMs ship no pad token)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0


def prompt_rows(tokenizer, texts: list[str]) -> list[list[int]]:
    """Each prompt's token ids, unpadded, as `encode_prompts` encodes them (a serving engine takes them so)."""
    ids, mask = encode_prompts(tokenizer, texts)
    return [r[m.bool()].tolist() for r, m in zip(ids, mask)]
