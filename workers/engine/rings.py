"""Rings for sliding-window layers: a static pool keeps a windowed layer's keys and values in R = window + slack
positions (rounded up to 16), position p at ring slot p mod R, rather than in every position of the slot.

Why that is exact. A query at position q of a layer with window W sees the keys at (q - W, q]. After a step whose
last position is P, ring slot j holds the latest position p <= P with p = j (mod R) (`held`): every position of
(P - R, P] is there, and R >= W + T - 1 covers every query of a step of T tokens. What a slot may hold instead is
stale: written past the sequence's committed length (a rejected draft, padding) and not yet overwritten. Such an
entry at position s is read as s - R, one lap earlier, and stays outside every window of a query at L or later as
long as s < L + R - W + 1 for the sequence's length L: a cache refuses a rollback further back than R - W + 1 from
the furthest position it wrote there (`StaticKVCache.crop`; a step too long for the ring writes no padding, and an
emptied cache rewrites from position 0 in order), and the engines' slack covers their longest round and whole draft.

A step longer than R - W + 1 tokens (a prompt) would overwrite keys its own first tokens see: it attends over the
ring as it was before the step joined to the step's own keys and values (`is_long`), and then writes each row's last
R real positions (`long_writes`). Masks (`ring_mask`) follow the same two forms, so a layer's `update` and the mask
the shard built for it agree on the columns.
"""

from __future__ import annotations

from typing import Any

import torch


def ring_length(window: int, slack: int) -> int:
    """Positions a windowed layer's ring holds: the window and the slack, rounded up to 16 (kernel alignment)."""
    return -(-(window + slack) // 16) * 16


def is_long(tokens: int, ring: int, window: int) -> bool:
    """Whether a step of `tokens` would overwrite, while it runs, keys its own first query sees."""
    return tokens + window - 1 > ring


def held(last: torch.Tensor, ring: int) -> torch.Tensor:
    """[..., ring]: the position each ring slot holds once `last` [..., 1] is the latest written (the latest
    p <= last with p = slot mod ring; negative where no position of the sequence got there yet)."""
    j = torch.arange(ring, device=last.device)
    return last - torch.remainder(last - j, ring)


def seen(at: torch.Tensor, pos: torch.Tensor, window: int) -> torch.Tensor:
    """[..., T, L]: whether the query at pos[..., t] sees the key held at position at[..., l] (HF's sliding window:
    at or before the query, after q - window; never a column no position reached)."""
    k, q = at[..., None, :], pos[..., None]
    return (k <= q) & (k > q - window) & (k >= 0)


def ring_mask(pos: torch.Tensor, ring: int, window: int) -> torch.Tensor:
    """[..., T, ring] for a step at positions pos [..., T] over a ring written through pos[..., -1]; a long step's
    [..., T, ring + T]: the ring before the step, then the step's own keys."""
    if is_long(pos.shape[-1], ring, window):
        at = torch.cat([held(pos[..., :1] - 1, ring), pos], dim=-1)
    else:
        at = held(pos[..., -1:], ring)
    return seen(at, pos, window)


def long_writes(pos: torch.Tensor, last: torch.Tensor, ring: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions [B, n], their columns in the step [B, n]) a long step of rows at pos [B, T] writes to a ring:
    each row's last min(ring, T) positions up to last [B] (its last real token; padding after it is never
    written), clamped at the row's first position (a repeated position writes the same key again)."""
    n = min(ring, pos.shape[1])
    first = pos[:, :1]
    at = (last[:, None] - n + 1 + torch.arange(n, device=pos.device)).clamp(min=first)
    return at, at - first


def attention_layers(shard: Any) -> tuple[list[int], Any]:
    """The global indices of a shard's layers that attend (not its linear-attention ones), and the first's module."""
    attending = [layer.self_attn for layer in shard.layers if hasattr(layer, "self_attn")]
    return [m.layer_idx for m in attending], next(iter(attending), None)


def shard_windows(shard: Any) -> dict[int, int]:
    """A shard's windowed layers: global layer index -> its window (`Shard.windows`)."""
    windows = getattr(shard, "windows", [None] * len(shard.layers))
    pairs = zip(shard.layers, windows, strict=True)
    return {layer.self_attn.layer_idx: w for layer, w in pairs if w is not None and hasattr(layer, "self_attn")}


def ring_sizes(windows: dict[int, int], slack: int | None, full: int) -> dict[int, tuple[int, int]]:
    """layer -> (ring length, window) for the windowed layers a ring of `slack` keeps shorter than `full`."""
    if slack is None:
        return {}
    return {i: (ring_length(w, slack), w) for i, w in windows.items() if ring_length(w, slack) < full}


def write_ring(
    pool: Any,
    layer: int,
    slots: torch.Tensor,
    pos: torch.Tensor,
    last: torch.Tensor | None,
    k: torch.Tensor,
    v: torch.Tensor,
    gather: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write a step's keys/values k, v [B, heads, T, dim] of rows in `slots` [B, 1] at positions pos [B, T] into
    layer `layer`'s ring, and return what its attention reads: `gather(t)` of the ring tensors after the writes, or
    for a long step (workers/engine/rings.py) the ring as it was before them joined to k, v (last [B]: each row's
    last real position; None: its last)."""
    ring, window = pool.rings[layer]
    kr, vr = pool.keys[layer], pool.values[layer]
    if not is_long(pos.shape[1], ring, window):
        kr[slots, :, pos % ring] = k.transpose(1, 2)
        vr[slots, :, pos % ring] = v.transpose(1, 2)
        return gather(kr), gather(vr)
    before_k, before_v = (t.clone() if t._is_view() else t for t in (gather(kr), gather(vr)))
    at, col = long_writes(pos, pos[:, -1] if last is None else last, ring)
    batch = torch.arange(pos.shape[0], device=pos.device)[:, None]
    kr[slots, :, at % ring] = k.transpose(1, 2)[batch, col]
    vr[slots, :, at % ring] = v.transpose(1, 2)[batch, col]
    return torch.cat([before_k, k], dim=2), torch.cat([before_v, v], dim=2)
