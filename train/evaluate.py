"""Measure a draft against its target with the bundled sampler on prompt sets (JSONL: `prompt`, `domain`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from sampling import autoregressive_generate, speculative_generate
from sampling.feature import is_feature_draft
from sampling.probs import SamplingConfig, process_logits
from sampling.rejection import expected_acceptance
from train.feature import feature_alpha
from train.onpolicy import Batch

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
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i + 1}: not a JSON object ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{i + 1}: not a JSON object")
        if not isinstance(row.get("prompt"), str) or not row["prompt"]:
            raise ValueError(f"{path}:{i + 1}: each line needs a non-empty string field 'prompt'")
        rows.append({"prompt": row["prompt"], "domain": row.get("domain", path.stem)})
    if not rows:
        raise ValueError(f"{path} holds no usable prompt (JSONL, one object with a 'prompt' string per line)")
    return rows[:n] if n else rows


def encode_batch(tokenizer, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and attention mask, so a batch of prompts of different lengths decodes together."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    return enc.input_ids, enc.attention_mask


def acceptance_by_set(target, draft, tokenizer, prompt_sets, *, n_prompts: int | None, k: int, temperature: float,
                      top_p: float, top_k: int = 0, max_new_tokens: int = 64, seed: int = 0,
                      on_target: bool = False) -> dict:
    """{prompt set: acceptance(...)} for shipped prompt set names or JSONL paths."""
    return {ps: acceptance(target, draft, tokenizer, [r["prompt"] for r in load_prompts(ps, n_prompts)], k=k,
                           temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
                           seed=seed, on_target=on_target)
            for ps in prompt_sets}


def acceptance(target, draft, tokenizer, prompts: list[str], *, k: int, temperature: float, top_p: float,
               top_k: int = 0, max_new_tokens: int = 64, seed: int = 0, on_target: bool = False) -> dict:
    """alpha, alpha_analytic (on the sampler's own trajectories), tokens_per_call over a batch of prompts; with
    on_target, also `alpha_on_target` (teacher-forced on the target's own samples of the same prompts: no
    sampling noise, so small differences between drafts are visible)."""
    ids, mask = encode_batch(tokenizer, prompts)
    gen = speculative_generate(target, draft, ids, attention_mask=mask, max_new_tokens=max_new_tokens, k=k,
                               temperature=temperature, top_p=top_p, top_k=top_k,
                               generator=torch.Generator().manual_seed(seed))
    s = gen.stats
    out = {"alpha": s.alpha, "alpha_analytic": s.alpha_analytic, "tokens_per_call": s.tokens_per_call,
           "acceptance_by_position": s.acceptance_by_position, "prompts": len(prompts), "new_tokens": s.new_tokens}
    if on_target:
        samples = target_samples(target, ids, mask, max_new_tokens=max_new_tokens, temperature=temperature,
                                 top_p=top_p, top_k=top_k, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id or 0, seed=seed + 1)
        out["alpha_on_target"] = alpha_on_samples(target, draft, samples, SamplingConfig(temperature, top_k, top_p),
                                                  k=k)
    return out


def target_samples(target, prompts: torch.Tensor, prompt_mask: torch.Tensor, *, max_new_tokens: int,
                   temperature: float, top_p: float, top_k: int = 0, eos_token_id=None, pad_token_id: int = 0,
                   seed: int = 0) -> Batch:
    """The target's own continuations of left-padded prompts, as a teacher-forcing batch: ids (B, P+N), mask
    (left padding and the tail after an early EOS are 0), loss_mask on the sampled tokens (EOS included)."""
    gen = autoregressive_generate(target, prompts, attention_mask=prompt_mask, max_new_tokens=max_new_tokens,
                                  temperature=temperature, top_p=top_p, top_k=top_k, eos_token_id=eos_token_id,
                                  generator=torch.Generator().manual_seed(seed))
    B, P = prompts.shape
    ids = torch.full((B, P + max_new_tokens), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    ids[:, :P], mask[:, :P] = prompts, prompt_mask
    for i, toks in enumerate(gen.tokens):
        ids[i, P: P + len(toks)] = toks
        mask[i, P: P + len(toks)] = 1
    loss_mask = mask[:, 1:].bool().clone()
    loss_mask[:, : P - 1] = False  # labels from position P on are the target's samples
    return Batch(ids, mask, loss_mask)


@torch.no_grad()
def alpha_on_samples(target, draft, samples: Batch, cfg: SamplingConfig, chunk: int = 512, k: int = 4) -> float:
    """Teacher-forced alpha_analytic (mean of sum_x min(p, q) over the processed distributions) on the positions
    of `samples.loss_mask`: one batched forward of each model. On the target's own samples it is
    `alpha_on_target` (DESIGN.md section 2): what the sampler will meet, with no sampling noise. A feature draft's
    is the mean over its k drafting steps, each unrolled on its own outputs as the sampler runs it."""
    if is_feature_draft(draft):
        steps = feature_alpha(target, draft, samples, cfg, k)
        return sum(steps) / len(steps)
    keep = samples.loss_mask.reshape(-1).nonzero().squeeze(1)
    lp, lq = samples.logits(draft), samples.logits(target)
    V = lp.shape[-1]
    lp, lq = lp.reshape(-1, V).index_select(0, keep), lq.reshape(-1, V).index_select(0, keep)
    acc = [expected_acceptance(process_logits(a, cfg), process_logits(b, cfg))
           for a, b in zip(lp.split(chunk), lq.split(chunk))]
    return float(torch.cat(acc).mean())
