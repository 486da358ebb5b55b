"""A KV cache written in place into buffers sized once per generation.

transformers' DynamicCache appends with `torch.cat`: every decoding step copies each layer's whole cache, so a
token costs O(length) in copies, and the allocator, handed a slightly larger block per layer per step, keeps RSS
growing past the cache itself (measured on the demo target at batch 16 and 200 tokens: 293 MB beyond the KV
caches). Here each layer's keys and values live in one buffer of the generation's final length, written in
place; the model sees views of the filled part. Rollback (`crop`) only moves the fill mark. Used where that
length is known (plain sampling); speculative decoding's masked holes make it unknown (sampling/speculative.py).
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
