"""A per-sequence KV cache for a slice of layers, with exact rollback.

Decoder layers call `update(keys, values, layer_idx)` and attend over what it returns; ShardFlow crops
it back to the committed prefix after each round. Layers are keyed by their global index, so a tail's
cache simply has no entries for the head's layers.
"""

from __future__ import annotations

from typing import Any

import torch


class KVCache:
    """Keys and values of one sequence for the layers of one shard."""

    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *_: Any, **__: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this step's keys/values for `layer_idx`; return everything cached for it."""
        if layer_idx in self.keys:
            key_states = torch.cat([self.keys[layer_idx], key_states], dim=-2)
            value_states = torch.cat([self.values[layer_idx], value_states], dim=-2)
        self.keys[layer_idx], self.values[layer_idx] = key_states, value_states
        return key_states, value_states

    def get_seq_length(self, layer_idx: int | None = None) -> int:
        if not self.keys:
            return 0
        idx = layer_idx if layer_idx is not None else next(iter(self.keys))
        return self.keys[idx].shape[-2] if idx in self.keys else 0

    @property
    def length(self) -> int:
        return self.get_seq_length()

    def crop(self, length: int) -> None:
        """Keep only the first `length` positions (rollback to a committed prefix)."""
        if length < 0 or length > self.length:
            raise ValueError(f"cannot crop a cache of {self.length} positions to {length}")
        for idx in self.keys:
            self.keys[idx] = self.keys[idx][..., :length, :]
            self.values[idx] = self.values[idx][..., :length, :]
