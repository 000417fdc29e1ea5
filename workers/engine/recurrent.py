"""Caches for shards with linear-attention layers (Qwen3-Next and Qwen3.5's Gated DeltaNet): beside the keys and
values of their full-attention layers, each linear layer keeps a convolution state and a recurrent state
(transformers' own `LinearAttentionLayer`, which its layers update through the cache).

A recurrent state cannot be cut back to a shorter prefix as keys and values are: it is one state after all the
tokens it has seen. So a `RecurrentCache` remembers its states at a base (the length it last committed to: its last
rollback) and the inputs fed since. Rolling back to a length past the base restores the base's states and feeds
the kept inputs again (`replay`: the shard's own forward), so a rejected draft leaves the states exactly as a
cache that never saw it. Keeping every round's whole draft costs nothing more; a partial one costs a second
forward over the tokens kept. This is the dynamic cache (`--dynamic-cache`), one sequence at a time; static caches,
the default, keep such layers' states in their pool (workers/engine/linear_pool.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import LinearAttentionLayer

from workers.engine.kvcache import KVCache
from workers.engine.linear_pool import linear_modules

# families whose linear-attention layers update their states through a cache's LinearAttentionLayer protocol
RECURRENT = {"qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"}
Replay = Callable[[torch.Tensor, int, "RecurrentCache"], object]


def linear_layers(layers: nn.ModuleList) -> list[int]:
    """Global indices of the layers with a linear-attention mixer (no `self_attn`)."""
    return list(linear_modules(layers))


def state_bytes(layer: nn.Module, dtype_bytes: int) -> int:
    """Bytes one sequence's state takes in a linear-attention layer (`linear_attn`, 0 for another): its
    convolution's window of inputs, and its recurrent state (counted float32, as the delta rule keeps it)."""
    m = getattr(layer, "linear_attn", None)
    if m is None:
        return 0
    return m.conv_dim * m.conv_kernel_size * dtype_bytes + m.num_v_heads * m.head_k_dim * m.head_v_dim * 4


class RecurrentCache(KVCache):
    """A dynamic cache whose linear layers' states roll back by restore and replay (see the module docstring)."""

    def __init__(self, linear: list[int], replay: Replay) -> None:
        super().__init__()
        self.layers: dict[int, LinearAttentionLayer] = {i: LinearAttentionLayer() for i in linear}
        self._length = 0
        self._replay = replay
        self._base: tuple[int, dict] | None = None  # (length, states) where the inputs since were first fed
        self._fed: list[torch.Tensor] = []

    # the protocol transformers' linear-attention layers call
    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return layer_idx in self.layers and self.layers[layer_idx].has_previous_state[state_idx or 0]

    def update_conv_state(self, conv: torch.Tensor, layer_idx: int, state_idx: int = 0, **kw: Any) -> torch.Tensor:
        return self.layers[layer_idx].update_conv_state(conv, state_idx, **kw)

    def update_recurrent_state(
        self, state: torch.Tensor, layer_idx: int, state_idx: int = 0, **kw: Any
    ) -> torch.Tensor:
        return self.layers[layer_idx].update_recurrent_state(state, state_idx, **kw)

    @property
    def length(self) -> int:
        return self._length

    def get_seq_length(self, layer_idx: int | None = None) -> int:
        return self._length

    def begin(self, x: torch.Tensor, start: int) -> None:
        """A forward of x at `start` is about to run (Shard.forward): the base's states are kept before the first."""
        if self._base is None:
            self._base = (start, self._states())
        self._fed.append(x)
        if not torch.is_inference_mode_enabled():  # states made in inference mode cannot be updated in place outside
            for layer in self.layers.values():
                for states in (layer.conv_states, layer.recurrent_states):
                    for s, t in states.items():
                        if t is not None and t.is_inference():
                            states[s] = t.clone()

    def end(self, n: int) -> None:
        self._length += n

    def crop(self, length: int) -> None:
        """Roll back to the first `length` positions (at or past the base), and commit to them."""
        if length < 0 or length > self._length:
            raise ValueError(f"cannot crop a cache of {self._length} positions to {length}")
        base, states = self._base if self._base is not None else (self._length, None)
        if length < base:
            raise ValueError(f"a recurrent state rolls back to its base ({base} positions), not to {length}")
        if length < self._length and states is not None:
            kept = torch.cat(self._fed)[: length - base]
            super().crop(base)
            self._restore(states)
            self._length, self._base, self._fed = base, None, []
            if kept.shape[0]:
                self._replay(kept, base, self)
        self._base, self._fed = None, []

    def _states(self) -> dict:
        return {
            i: (
                {s: t.clone() for s, t in layer.conv_states.items() if t is not None},
                {s: t.clone() for s, t in layer.recurrent_states.items() if t is not None},
                dict(layer.has_previous_state),
            )
            for i, layer in self.layers.items()
        }

    def _restore(self, states: dict) -> None:
        for i, (conv, recurrent, had) in states.items():
            layer = self.layers[i]
            for s, t in conv.items():
                layer.conv_states[s] = t
            for s, t in recurrent.items():  # the kept copies themselves (a forward outside inference mode may follow)
                layer.recurrent_states[s] = t
            layer.has_previous_state = dict(had)
            if not any(had.values()):  # the base was the empty sequence: start afresh
                self.layers[i] = LinearAttentionLayer()
