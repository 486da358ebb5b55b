"""Conversations as training samples: rendered through the target's chat template, the assistant's tokens marked
as the ones trained on, cut to the block, and batched so that no sample sees another.

- `render`: the template's text, tokenized once without adding special tokens (the template writes the BOS itself;
  a tokenizer that adds one too would give every sample two), with a mask of the tokens inside assistant turns (the
  turn's text and the template's end-of-turn marker: the draft must also learn where a turn ends). System, user and
  tool turns are context only.
- `cut`: a sample always starts at its conversation's start; whole trailing turns are dropped until it fits the
  block; a first exchange that alone is too long keeps the head of its assistant turn (counted).
- `chat_batches`: length-bucketed padding (each row one sample from position 0, right-padded, attending only to
  itself): samples of similar length share a batch, whose width is rounded up to a multiple of `multiple` so that
  a compiled loss sees few shapes. Packing with a block-diagonal mask would waste no padding, but it needs a 4-D
  mask path through every model's attention; padding needs nothing but the attention mask every model takes.
This module imports neither Lightning nor Hydra.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from draftsmith.sampling.errors import DraftsmithError

TAIL_CUT, PROMPT_TOO_LONG = "assistant tail cut to fit the block", "prompt alone longer than the block"


@dataclass
class Sample:
    ids: list[int]
    trained: list[bool]  # per token: inside an assistant turn (its label carries the loss)
    turn_ends: list[int]  # token index just after each assistant turn


def template_text(tokenizer, messages: list[dict], generation_prompt: bool = False,
                  enable_thinking: bool | None = None) -> str:
    """The target's chat template over `messages` as text; `enable_thinking` None leaves the template's default."""
    kw = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **kw)


def render(tokenizer, messages: list[dict], enable_thinking: bool | None = None) -> Sample:
    """The conversation's tokens and which of them are the assistant's. Each assistant turn's text is the
    difference between the template over the turns before it with the generation prompt, and over the turns up to
    and including it: exactly what the target writes when it answers there."""
    if not getattr(tokenizer, "chat_template", None):
        raise DraftsmithError("data=chat needs the target's chat template, and its tokenizer has none: use a chat "
                              "(Instruct) target or a tokenizer with a chat_template")
    full = template_text(tokenizer, messages, enable_thinking=enable_thinking)
    spans = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = template_text(tokenizer, messages[:k], True, enable_thinking)
        upto = template_text(tokenizer, messages[: k + 1], False, enable_thinking)
        if not (upto.startswith(before) and full.startswith(upto)):
            raise DraftsmithError("the target's chat template renders earlier turns differently once later ones "
                                  "follow (e.g. it strips thinking from past turns), so its assistant tokens cannot "
                                  "be marked in one pass: train on the last turn only (data.last_turn_only=true)")
        # the turn ends at its end-of-turn marker: the template's whitespace after it is never sampled
        spans.append((len(before), len(upto.rstrip())))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    trained = [any(a <= s < b for a, b in spans) for s, _ in offsets]
    ends = [sum(1 for s, _ in offsets if s < b) for _, b in spans]
    return Sample(ids, trained, ends)


def cut(sample: Sample, block_size: int, counts: Counter) -> Sample | None:
    """`sample` cut to `block_size` tokens by the rules above; None (counted) when not even one assistant token
    fits."""
    if len(sample.ids) <= block_size:
        return sample
    fit = [e for e in sample.turn_ends if e <= block_size]
    if fit:
        end = max(fit)
        return Sample(sample.ids[:end], sample.trained[:end], [e for e in sample.turn_ends if e <= end])
    first = sample.trained.index(True) if True in sample.trained else len(sample.ids)
    if first >= block_size:
        counts[PROMPT_TOO_LONG] += 1
        return None
    counts[TAIL_CUT] += 1
    return Sample(sample.ids[:block_size], sample.trained[:block_size], [block_size])


def last_turn_only(sample: Sample) -> Sample:
    """Only the last assistant turn trained on (the earlier ones stay as context)."""
    if len(sample.turn_ends) < 2:
        return sample
    start = sample.turn_ends[-2]
    return Sample(sample.ids, [t and i >= start for i, t in enumerate(sample.trained)], sample.turn_ends[-1:])


def chat_batches(samples: list[Sample], batch_size: int, pad: int, multiple: int = 32,
                 seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Samples grouped into padded batches: {"ids" (B, L), "mask" (B, L), "loss_mask" (B, L-1), "rows" (B,)}; row i
    is one sample from position 0, right-padded; loss_mask marks the labels (ids[:, 1:]) the loss is taken on; rows
    are the samples' indices in `samples` (the key of the target's logits kept for them). Samples are
    sorted by length (ties in a seeded order), so a batch's rows are close in length; the batches' order is the
    loader's to shuffle (train/data.py)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    tie = torch.randperm(len(samples), generator=g, device="cpu").tolist()
    order = sorted(range(len(samples)), key=lambda i: (len(samples[i].ids), tie[i]))
    out = []
    for lo in range(0, len(order), batch_size):
        picked = order[lo: lo + batch_size]
        rows = [samples[i] for i in picked]
        if len(rows) < batch_size and out:
            break  # a short last batch would be one more shape to compile for
        width = -(-max(len(r.ids) for r in rows) // multiple) * multiple
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        trained = torch.zeros((len(rows), width), dtype=torch.bool)
        for j, r in enumerate(rows):
            ids[j, : len(r.ids)] = torch.tensor(r.ids)
            mask[j, : len(r.ids)] = 1
            trained[j, : len(r.ids)] = torch.tensor(r.trained)
        out.append({"ids": ids, "mask": mask, "loss_mask": trained[:, 1:], "rows": torch.tensor(picked)})
    return out


def padding_share(batches: list[dict]) -> float:
    """The fraction of batch positions that are padding (the cost of padding against packing)."""
    total = sum(b["mask"].numel() for b in batches)
    return 1.0 - sum(int(b["mask"].sum()) for b in batches) / max(1, total)


def show(tokenizer, batch: dict, row: int = 0) -> str:
    """One sample as text, the trained tokens between ⟦ and ⟧ (what `draftsmith data --show` prints)."""
    n = int(batch["mask"][row].sum())
    ids = batch["ids"][row, :n].tolist()
    trained = [False] + batch["loss_mask"][row, : n - 1].tolist()
    out, inside = [], False
    for t, on in zip(ids, trained):
        if on != inside:
            out.append("⟦" if on else "⟧")
            inside = on
        out.append(tokenizer.decode([t]))
    if inside:
        out.append("⟧")
    return "".join(out)
