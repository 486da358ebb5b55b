"""A batch of token rows and the logits a model gives on them: what a draft is trained and measured on."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    """A training batch. ids (B, T); mask (B, T) marks real tokens (left padding of prompts is 0), None when all
    real; loss_mask (B, T-1) marks the label positions the loss is taken on, None when all; its first `sampled`
    rows are the draft's own (no corpus block behind them, so the target must score them afresh). `position_ids`
    (B, T): rows packed with several samples (data.rows=packed), each restarting at 0, which transformers reads as
    one causal mask per sample; `no_loss` (B, T-1): label positions that carry no loss but keep the batch's shape
    (padding, a label in the next sample), unlike `loss_mask`, which drops positions."""

    ids: torch.Tensor
    mask: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None
    sampled: int = 0
    position_ids: torch.Tensor | None = None
    no_loss: torch.Tensor | None = None

    def positions(self) -> torch.Tensor | None:
        """Position ids that skip left padding (RoPE must see a padded prompt at its true positions), or the packed
        rows' own."""
        if self.position_ids is not None:
            return self.position_ids
        if self.mask is None:
            return None
        return (self.mask.long().cumsum(1) - 1).clamp_min(0)

    def logits(self, model, head: HeadRows | None = None) -> torch.Tensor:
        """(B, T-1, V) logits at every position but the last (whose prediction has no label), padding-aware;
        (B, T-1, N) over a pruned head's rows when `head` is given (the other rows are never computed)."""
        pos = self.positions()
        # no KV cache for a pass without grad (the target's): nothing else holds its keys and values, which would sit
        # beside the draft's logits (2 x layers x tokens x KV width, 2.7 GB a micro-batch at 70B). A pass with grad
        # keeps the cache transformers builds: autograd holds those tensors anyway, and without a cache transformers
        # reads the positions back from the device at every pass (its packed-sequence check)
        kw = dict(input_ids=self.ids[:, :-1], attention_mask=None if self.mask is None else self.mask[:, :-1],
                  position_ids=None if pos is None else pos[:, :-1])
        if not torch.is_grad_enabled():
            kw["use_cache"] = False
        if head is None:
            return model(**kw).logits
        return head(model.model(**kw).last_hidden_state)


class HeadRows(torch.nn.Module):
    """The rows `token_ids` of a model's output head, as a linear layer computed in this module's own forward.
    Under ZeRO-3 a weight read outside its owner's forward is an empty shard: DeepSpeed gathers it for this forward
    once it is registered as this module's external parameter (`DraftModule.on_fit_start`). Holds no weight of its
    own: the model's head stays the one trained and saved."""

    def __init__(self, model, token_ids: torch.Tensor):
        super().__init__()
        self._model = [model]  # a list: not a submodule, its weights are the draft's
        self.register_buffer("token_ids", token_ids.to(torch.long), persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self._model[0].get_output_embeddings().weight
        return torch.nn.functional.linear(hidden, weight.index_select(0, self.token_ids))
