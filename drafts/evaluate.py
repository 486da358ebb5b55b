"""Measure a draft against its target with the bundled sampler on prompt sets (JSONL: `prompt`, `domain`)."""

from __future__ import annotations

import torch

from draftsmith.drafts.batch import Batch
from draftsmith.drafts.feature import feature_alpha
from draftsmith.sampling import autoregressive_generate, speculative_generate
from draftsmith.sampling.errors import DraftsmithError
from draftsmith.sampling.feature import is_feature_draft
from draftsmith.sampling.machine import device_of, seeded
from draftsmith.sampling.probs import SamplingConfig
from draftsmith.sampling.prompts import encode_prompts, load_prompts, pad_id, user_turn
from draftsmith.sampling.rejection import teacher_forced_acceptance

CHAT_SET = "chat"  # the benchmark ShareGPT conversations' first turns (never trained or validated on), templated
CHAT_PROMPT_TOKENS = 256  # a chat prompt's most tokens: longer first turns are passed over, never cut (a template cut
                          # on the left loses its header, and the draft would be judged on text no user sends)


def acceptance_by_set(target, draft, tokenizer, prompt_sets, *, n_prompts: int | None, k: int, temperature: float,
                      top_p: float, top_k: int = 0, max_new_tokens: int = 64, seed: int = 0,
                      on_target: bool = False, chat: dict | None = None) -> dict:
    """{prompt set: acceptance(...)} for shipped prompt set names or JSONL paths. `chat` is the held-out ShareGPT
    split's first turns through the target's chat template. With `chat` ({"enable_thinking"}: a draft trained
    through the template) every other set's prompts are one user turn through it too, as the draft met its prompts
    in training; without, they are raw openings as shipped."""
    thinking = (chat or {}).get("enable_thinking")
    out = {}
    for ps in prompt_sets:
        if ps == CHAT_SET:
            texts, special = chat_prompts(tokenizer, n_prompts or 8, thinking), False
        else:
            texts = [r["prompt"] for r in load_prompts(ps, n_prompts)]
            texts, special = (texts, True) if chat is None else ([user_turn(tokenizer, t, thinking) for t in texts],
                                                                 False)  # the template writes the BOS
        out[ps] = acceptance(target, draft, tokenizer, texts, k=k, temperature=temperature, top_p=top_p, top_k=top_k,
                             max_new_tokens=max_new_tokens, seed=seed, on_target=on_target, special_tokens=special)
    return out


def chat_prompts(tokenizer, n: int, enable_thinking: bool | None = None) -> list[str]:
    """The first `n` benchmark ShareGPT first turns (held out, and not the validation half) whose templated prompt
    holds at most CHAT_PROMPT_TOKENS tokens, as the template's text with the generation prompt (it holds its own
    special tokens)."""
    from draftsmith.data.chat import template_text
    from draftsmith.data.conversations import heldout_chat_set

    if not getattr(tokenizer, "chat_template", None):
        raise DraftsmithError("the chat prompt set needs the target's chat template, and its tokenizer has none: use "
                              "a chat (Instruct) target or leave `chat` out of eval.prompt_sets")
    out = []
    for messages in heldout_chat_set(8 * n):  # ShareGPT's first turns run long: read more than needed
        first = next(i for i, m in enumerate(messages) if m["role"] == "user")
        text = template_text(tokenizer, messages[: first + 1], True, enable_thinking)
        if len(tokenizer(text, add_special_tokens=False)["input_ids"]) <= CHAT_PROMPT_TOKENS:
            out.append(text)
            if len(out) == n:
                return out
    raise DraftsmithError(f"only {len(out)} held-out chat prompts fit {CHAT_PROMPT_TOKENS} tokens, fewer than the "
                          f"{n} asked: lower eval.n_prompts")


def acceptance(target, draft, tokenizer, prompts: list[str], *, k: int, temperature: float, top_p: float,
               top_k: int = 0, max_new_tokens: int = 64, seed: int = 0, on_target: bool = False,
               special_tokens: bool = True) -> dict:
    """alpha, alpha_analytic (on the sampler's own trajectories), tokens_per_call over a batch of prompts; with
    on_target, also `alpha_on_target` (teacher-forced on the target's own samples of the same prompts: no
    sampling noise, so small differences between drafts are visible). special_tokens=False for prompts that hold
    their own (a chat template's text)."""
    ids, mask = (t.to(device_of(target)) for t in encode_prompts(tokenizer, prompts, special_tokens=special_tokens))
    gen = speculative_generate(target, draft, ids, attention_mask=mask, max_new_tokens=max_new_tokens, k=k,
                               temperature=temperature, top_p=top_p, top_k=top_k,
                               generator=seeded(device_of(target), seed))
    s = gen.stats
    out = {"alpha": s.alpha, "alpha_analytic": s.alpha_analytic, "tokens_per_call": s.tokens_per_call,
           "acceptance_by_position": s.acceptance_by_position, "prompts": len(prompts), "new_tokens": s.new_tokens}
    if on_target:
        samples = target_samples(target, ids, mask, max_new_tokens=max_new_tokens, temperature=temperature,
                                 top_p=top_p, top_k=top_k, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=pad_id(tokenizer), seed=seed + 1)
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
                                  generator=seeded(device_of(target), seed))
    B, P = prompts.shape
    ids = torch.full((B, P + max_new_tokens), pad_token_id, dtype=torch.long, device=prompts.device)
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
    `alpha_on_target` (docs/design.md): what the sampler will meet, with no sampling noise. A feature draft's
    is the mean over its k drafting steps, each unrolled on its own outputs as the sampler runs it."""
    if is_feature_draft(draft):
        steps = feature_alpha(target, draft, samples, cfg, k)
        return sum(steps) / len(steps)
    keep = samples.loss_mask.reshape(-1).nonzero().squeeze(1)
    lp, lq = samples.logits(draft), samples.logits(target)
    V = lp.shape[-1]
    lp, lq = lp.reshape(-1, V).index_select(0, keep), lq.reshape(-1, V).index_select(0, keep)
    return float(teacher_forced_acceptance(lp, lq, cfg, chunk=chunk).mean())
