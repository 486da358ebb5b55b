"""Measure a draft against its target with the bundled sampler on prompt sets (JSONL: `prompt`, `domain`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from sampling import speculative_generate

PROMPTS_DIR = Path(__file__).resolve().parent.parent / "recipes" / "prompts"


def load_prompts(name_or_path: str, n: int | None = None) -> list[dict]:
    """A shipped prompt set (`code`, `english`) or any JSONL file with a `prompt` field."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PROMPTS_DIR / f"{name_or_path}.jsonl"
    if not path.is_file():
        shipped = ", ".join(p.stem for p in sorted(PROMPTS_DIR.glob("*.jsonl")))
        raise ValueError(f"prompt set not found: {name_or_path} (shipped: {shipped}, or a .jsonl path)")
    rows = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row.get("prompt"), str) or not row["prompt"]:
            raise ValueError(f"{path}:{i + 1}: each line needs a non-empty string field 'prompt'")
        rows.append({"prompt": row["prompt"], "domain": row.get("domain", path.stem)})
    if not rows:
        raise ValueError(f"{path} holds no prompts")
    return rows[:n] if n else rows


def encode_batch(tokenizer, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and attention mask, so a batch of prompts of different lengths decodes together."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    return enc.input_ids, enc.attention_mask


def acceptance_by_set(target, draft, tokenizer, prompt_sets, *, n_prompts: int | None, k: int, temperature: float,
                      top_p: float, top_k: int = 0, max_new_tokens: int = 64, seed: int = 0) -> dict:
    """{prompt set: acceptance(...)} for shipped prompt set names or JSONL paths."""
    return {ps: acceptance(target, draft, tokenizer, [r["prompt"] for r in load_prompts(ps, n_prompts)], k=k,
                           temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
                           seed=seed)
            for ps in prompt_sets}


def acceptance(target, draft, tokenizer, prompts: list[str], *, k: int, temperature: float, top_p: float,
               top_k: int = 0, max_new_tokens: int = 64, seed: int = 0) -> dict:
    """alpha, alpha_analytic (on the sampler's own trajectories), tokens_per_call over a batch of prompts."""
    ids, mask = encode_batch(tokenizer, prompts)
    gen = speculative_generate(target, draft, ids, attention_mask=mask, max_new_tokens=max_new_tokens, k=k,
                               temperature=temperature, top_p=top_p, top_k=top_k,
                               generator=torch.Generator().manual_seed(seed))
    s = gen.stats
    return {"alpha": s.alpha, "alpha_analytic": s.alpha_analytic, "tokens_per_call": s.tokens_per_call,
            "acceptance_by_position": s.acceptance_by_position, "prompts": len(prompts), "new_tokens": s.new_tokens}
