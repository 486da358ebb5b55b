"""A KV cache written in place into buffers sized once per generation.

transformers' DynamicCache appends with `torch.cat`: every decoding step copies each layer's whole cache, so a
token costs O(length) in copies, and the allocator, handed a slightly larger block per layer per step, keeps RSS
growing past the cache itself (measured on the demo target at batch 16 and 200 tokens: 293 MB beyond the KV
caches). Here each layer's keys and values live in one buffer of the generation's final length, written in
place; the model sees views of the filled part. Rollback (`crop`) only moves the fill mark.

Speculative decoding at batch > 1 leaves masked holes (rejected slots of rows that accepted less than others):
`compact_cache` moves each row's valid slots to the front, so the cache stays within the generation's length
plus a bounded number of holes, and one buffer of that size serves the whole generation.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer


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
            raise ValueError(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
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


def compact_cache(cache, valid: torch.Tensor) -> torch.Tensor | None:
    """Move each row's valid slots (`valid` (B, S) bool) to the front, in order, and drop the holes: returns the
    new (B, n) valid mask, n = the most valid slots of any row. Exact: keys carry their RoPE positions already,
    and attention over a row's valid slots does not depend on where they sit. None (nothing changed) when a
    layer cannot be compacted (a sliding-window layer keeps only its last slots, a plain DynamicLayer is not
    written in place)."""
    layers = getattr(cache, "layers", [cache])  # a preallocated cache, or a cache of one layer (the feature draft's)
    if not all(hasattr(layer, "gather_slots") for layer in layers):
        return None
    n = int(valid.sum(1).max())
    index = torch.sort((~valid).to(torch.uint8), dim=1, stable=True).indices[:, :n]  # valid slots first, in order
    for layer in layers:
        layer.gather_slots(index)
    return valid.gather(1, index)
