"""A KV cache written in place into buffers sized once per generation.

transformers' DynamicCache appends with `torch.cat`: every decoding step copies each layer's whole cache, so a token
costs O(length) in copies, and the allocator, handed a slightly larger block per layer per step, keeps RSS growing
past the cache itself (docs/results.md, Memory). Here each layer's keys and values live in one buffer of the
generation's final length, written in place; the model sees views of the filled part. Rollback (`crop`) only moves
the fill mark.

Speculative decoding at batch > 1 leaves masked holes (rejected slots of rows that accepted less than others):
`compact_cache` moves each row's valid slots to the front, so the cache stays within the generation's length
plus a bounded number of holes, and one buffer of that size serves the whole generation.

`Decoder` is one model's decoding state over such a cache (which slots each row may attend to), shared by the
sampler's loops; `sampling/compiled.py` derives its static-shape version from it.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from draftsmith.sampling.errors import DraftsmithError


class PreallocatedLayer(DynamicLayer):
    """A DynamicLayer whose keys/values are views of a (B, H, capacity, D) buffer filled up to `length`."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity, self.length = capacity, 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        b, h, _, _ = key_states.shape
        self._k = key_states.new_empty(b, h, self.capacity, key_states.shape[-1])
        self._v = value_states.new_empty(b, h, self.capacity, value_states.shape[-1])
        self.length, self.is_initialized = 0, True
        self._view()

    def _view(self) -> None:
        self.keys, self.values = self._k[:, :, : self.length], self._v[:, :, : self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self._k.shape[-2]:  # longer than announced: grow by doubling (amortised, never per token)
            grow = max(end, 2 * self._k.shape[-2]) - self._k.shape[-2]
            self._k = torch.cat([self._k, self._k.new_empty(*self._k.shape[:2], grow, self._k.shape[-1])], 2)
            self._v = torch.cat([self._v, self._v.new_empty(*self._v.shape[:2], grow, self._v.shape[-1])], 2)
        self._k[:, :, self.length: end] = key_states
        self._v[:, :, self.length: end] = value_states
        self.length = end
        self._view()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise DraftsmithError(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
        if self.is_initialized and tokens_to_remove:
            self.length -= abs(tokens_to_remove)
            self._view()

    def gather_slots(self, index: torch.Tensor) -> None:
        """Keep slots `index` (B, n) of each row, in that order, as the first n (`compact_cache`)."""
        if self.is_initialized:
            n = index.shape[1]
            self._k[:, :, :n] = self.keys.gather(2, expand_slots(index, self.keys))
            self._v[:, :, :n] = self.values.gather(2, expand_slots(index, self.values))
            self.length = n
            self._view()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._k, self._v = self._k[indices], self._v[indices]
            self._view()

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._k, self._v = self._k.repeat_interleave(repeats, 0), self._v.repeat_interleave(repeats, 0)
            self._view()

    def reset(self) -> None:
        self._k = self._v = None
        self.length = 0
        super().reset()


def preallocated_cache(config, capacity: int) -> DynamicCache:
    """A DynamicCache for `config` whose full-attention layers are PreallocatedLayers of `capacity` tokens
    (sliding-window layers keep transformers' own, which are bounded already)."""
    cache = DynamicCache(config=config)
    cache.layers = [PreallocatedLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def expand_slots(index: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """(B, n) slot indices -> (B, H, n, D), to gather along a (B, H, S, D) cache's slots."""
    return index[:, None, :, None].expand(kv.shape[0], kv.shape[1], index.shape[1], kv.shape[3])


def compaction_order(valid: torch.Tensor, n: int) -> torch.Tensor:
    """(B, n) slot indices: each row's valid slots first, in order; n = the most valid slots of any row (the caller
    knows it on the host: counting here would read the device)."""
    return torch.sort((~valid).to(torch.uint8), dim=1, stable=True).indices[:, :n]


def compact_cache(cache, valid: torch.Tensor, n: int) -> torch.Tensor | None:
    """Move each row's valid slots (`valid` (B, S) bool, n the most of any row) to the front, in order, and drop
    the holes: returns the new (B, n) valid mask. Exact: keys carry their RoPE positions already, and attention over
    a row's valid slots does not depend on where they sit. None (nothing changed) when a layer cannot be compacted
    (a sliding-window layer keeps only its last slots, a plain DynamicLayer is not written in place)."""
    layers = getattr(cache, "layers", [cache])  # a preallocated cache, or a cache of one layer (the feature draft's)
    if not all(hasattr(layer, "gather_slots") for layer in layers):
        return None
    index = compaction_order(valid, n)
    for layer in layers:
        layer.gather_slots(index)
    return valid.gather(1, index)


def keep_index(logits_to_keep: int | None, T: int, device=None):
    """`logits_to_keep` for a forward over T new positions: the index tensor of the last ones when only some are
    kept. Their slice is a non-contiguous (B > 1, k, H) view, and a linear layer over a non-contiguous 3-D input
    falls back to a batched product that copies its weight once per row (torch 2.13 on a CPU: the demo's 49k-row
    head after a batch-64 prefill, hundreds of times slower in bf16 than over a gathered copy). Transformers' models
    and ours take the index as it is."""
    if isinstance(logits_to_keep, int) and 0 < logits_to_keep < T:
        return torch.arange(T - logits_to_keep, T, device=device)
    return logits_to_keep


def keep_last(hidden: torch.Tensor, logits_to_keep) -> torch.Tensor:
    """The positions of (B, T, H) hidden states that `logits_to_keep` (0: all, k: the last k, or an index tensor)
    names, contiguous (see `keep_index`)."""
    if isinstance(logits_to_keep, torch.Tensor):
        return hidden[:, logits_to_keep.to(hidden.device)]
    return hidden[:, -logits_to_keep:].contiguous() if logits_to_keep else hidden


def attention_mask(valid: torch.Tensor, q: int) -> torch.Tensor:
    """(B, 1, q, S) bool for q new tokens over (B, S) slot validity (the last q slots are theirs): each query sees
    the valid slots before it and itself (a padded query too: a softmax over no slot is NaN, and its output is never
    read). Handed to transformers as it is: given a 2-D mask it checks on the host whether the mask can be dropped,
    a read of the device in every step."""
    B, S = valid.shape
    mask = valid[:, None, None, :].expand(B, 1, q, S).clone()
    own = torch.eye(q, dtype=torch.bool, device=valid.device)
    mask[..., S - q:] &= torch.ones(q, q, dtype=torch.bool, device=valid.device).tril()
    mask[..., S - q:] |= own
    return mask


class Decoder:
    """One model's decoding state for the active rows: its KV cache and which cache slots are valid.

    Validity lives twice: on the model's device (`valid`, the attention mask) and on the host (`valid_host`), from
    which every decision is taken (crop, compaction, whether any slot is masked at all), so that a decoding step
    never reads the device: the sampler reads it once per loop, for the tokens it emits (sampling/speculative.py)."""

    def __init__(self, model, capacity: int | None = None, holes: int | None = None):
        """capacity: the cache length a generation can reach, when known: its KV cache is then allocated once and
        written in place. holes: speculative decoding keeps rejected slots as masked holes (batch > 1), so its
        caches would outgrow the tokens by up to (K + 1) / tokens_per_call; once more than `holes` slots of the
        longest row are holes, the cache is compacted (`compact_cache`), which bounds it by capacity
        (`draftsmith bench memory`; docs/results.md, Memory)."""
        self.model = model
        self.own_mask = hasattr(model, "new_cache")  # a feature draft: one layer of its own, a 2-D mask
        if self.own_mask:
            self.cache = model.new_cache(capacity)
        elif capacity is None:
            self.cache = DynamicCache(config=model.config)
        else:
            self.cache = preallocated_cache(model.config, capacity)
        self.valid: torch.Tensor | None = None  # (B, S) bool, on the model's device
        self.valid_host: torch.Tensor | None = None  # the same, on the host
        self.holes = holes
        self.compactions = 0

    def __call__(self, tokens, positions, valid, logits_to_keep: int | None, valid_host=None, **extra):
        """tokens, positions, valid: (B, T) on the device; `valid_host`: `valid` on the host (None: all valid).
        Returns the model output (`.logits`: (B, logits_to_keep, V)). `extra`: a feature draft's `features`."""
        if valid_host is None:
            valid_host = torch.ones(valid.shape, dtype=torch.bool, device="cpu")
        mask_host = valid_host if self.valid_host is None else torch.cat([self.valid_host, valid_host], dim=1)
        mask = valid if self.valid is None else torch.cat([self.valid, valid], dim=1)
        if bool(mask_host.all()):  # the host copy: no masked slot, the fast causal path
            attention = None
        else:
            attention = mask if self.own_mask else attention_mask(mask, tokens.shape[1])
        out = self.model(
            input_ids=tokens,
            position_ids=positions,
            attention_mask=attention,
            cache=self.cache,
            use_cache=True,
            logits_to_keep=keep_index(logits_to_keep, tokens.shape[1], tokens.device),
            **extra,
        )
        self.valid, self.valid_host = mask, mask_host
        return out

    def settle(self, new_valid: torch.Tensor, new_valid_host: torch.Tensor) -> None:
        """Set the validity of the newest slots (B, n) (on the device and, the same values, on the host), then crop
        trailing slots that no row uses, and compact when the holes exceed their budget."""
        n = new_valid.shape[1]
        S = self.valid.shape[1]
        self.valid[:, S - n:] = new_valid
        self.valid_host[:, S - n:] = new_valid_host
        used = self.valid_host.any(0).nonzero()
        keep = int(used[-1]) + 1 if len(used) else 0
        drop = S - keep
        if drop:
            self.cache.crop(-drop)  # transformers 5.x: a negative count of tokens to remove
            self.valid, self.valid_host = self.valid[:, :keep], self.valid_host[:, :keep]
        if self.holes is not None and keep - int(self.valid_host.sum(1).max()) > self.holes:
            self._compact()

    def _compact(self) -> None:
        n = int(self.valid_host.sum(1).max())
        valid = compact_cache(self.cache, self.valid, n)
        if valid is not None:
            self.valid = valid
            self.valid_host = self.valid_host.gather(1, compaction_order(self.valid_host, n))
            self.compactions += 1

    def select(self, rows: torch.Tensor, rows_host: torch.Tensor) -> None:
        """Keep the active rows `rows` (on the device; `rows_host` the same on the host)."""
        self.cache.batch_select_indices(rows)
        self.valid, self.valid_host = self.valid[rows], self.valid_host[rows_host]
