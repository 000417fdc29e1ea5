"""A whole draft's keys and values (workers/engine/graphs.py `greedy_steps`): the batch's rows copied out of a
`KVPool` once, each of the K steps writing its own in place there, and the positions the draft wrote copied back
at its end. A `BatchView` would gather every row's attended keys and values in every layer of every step (at 128
sequences of a 0.5B drafter, one index kernel took 16.2 ms of a 38 ms draft). A windowed layer's ring
(workers/engine/rings.py) is copied whole and written at its ring positions.
"""

from __future__ import annotations

from typing import Any

import torch

from workers.engine.kvcache import KVPool, causal
from workers.engine.linear_pool import View
from workers.engine.rings import is_long, ring_mask


def rows_of(t: torch.Tensor, rows: torch.Tensor, n: int, store: torch.Tensor | None) -> torch.Tensor:
    """t[rows, :, :n] as a new tensor, in `store` (flat storage) when given and large enough."""
    shape = (rows.shape[0], t.shape[1], n, *t.shape[3:])
    size = shape[0] * shape[1] * shape[2] * t[0, 0, 0].numel()
    if store is None or size > store.numel():
        return t[:, :, :n][rows]
    return torch.index_select(t[:, :, :n], 0, rows, out=store[:size].view(shape))


class DraftBuffer:
    """The keys and values of a batch's rows (slots `rows`, first `length` positions) copied out of a pool once,
    for the steps of one whole draft: `view(pos)` is one step's cache (its writes land here, in place, and its
    attention reads this copy: no gather per layer and step); `write_back(pos)` copies the positions the draft
    wrote to the rows' slots. Padding rows' positions past `length` (scratch) are clamped into the copy's last
    position: they only ever meet their own row's attention, as in a BatchView."""

    def __init__(self, pool: KVPool, rows: torch.Tensor, length: int | None = None) -> None:
        self.pool, self.rows = pool, rows
        self.length = length or pool.index.shape[0]
        store = pool.draft_copies()
        keys, values = store or ({}, {})
        n = {i: pool.length_of(i, self.length) for i in pool.keys}  # a ring is copied whole
        self.keys = {i: rows_of(k, rows, n[i], keys.get(i)) for i, k in pool.keys.items()}
        self.values = {i: rows_of(v, rows, n[i], values.get(i)) for i, v in pool.values.items()}
        self.batch = torch.arange(rows.shape[0], device=rows.device)[:, None]

    def view(self, pos: torch.Tensor) -> DraftStep:
        return DraftStep(self, pos)

    def write_back(self, pos: torch.Tensor) -> None:
        """Copy positions pos [B, P] of each row (every position the draft wrote) to its slot."""
        local, slots = pos.clamp(max=self.length - 1), self.rows[:, None]
        for i in self.keys:
            at, here = (pos % self.pool.rings[i][0],) * 2 if i in self.pool.rings else (pos, local)
            self.pool.keys[i][slots, :, at] = self.keys[i][self.batch, :, here]
            self.pool.values[i][slots, :, at] = self.values[i][self.batch, :, here]


class DraftStep:
    """One step of a draft over its `DraftBuffer` (the cache a shard's layers update and attend over)."""

    def __init__(self, buf: DraftBuffer, pos: torch.Tensor) -> None:
        self.buf, self.pos = buf, pos
        self.local = pos.clamp(max=buf.length - 1)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *_: Any, **__: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write [B, heads, T, dim] at the rows' positions of the copy; return the copy (every row's keys)."""
        k, v = self.buf.keys[layer_idx], self.buf.values[layer_idx]
        rings = self.buf.pool.rings
        local = self.pos % rings[layer_idx][0] if layer_idx in rings else self.local
        k[self.buf.batch, :, local] = key_states.transpose(1, 2)
        v[self.buf.batch, :, local] = value_states.transpose(1, 2)
        return k, v

    def linear_view(self) -> View:
        """Linear layers' states are not copied: each step reads and writes the pool's (linear_pool.py)."""
        assert self.buf.pool.linear is not None
        return self.buf.pool.linear, self.buf.rows, self.pos, None

    def get_seq_length(self, layer_idx: int | None = None) -> int:
        return 0

    def mask(self, pos: torch.Tensor, window: int | None = None) -> torch.Tensor:
        """As `BatchView.mask`: each row's token attends to its positions at or before its own."""
        ring = self.buf.pool.ring_of.get(window)  # type: ignore[arg-type]
        if ring is not None:
            if is_long(pos.shape[-1], ring, window):  # type: ignore[arg-type]
                raise ValueError(f"a draft step of {pos.shape[-1]} tokens is longer than a ring of {ring} allows")
            return ring_mask(pos, ring, window)[:, None]  # type: ignore[arg-type]
        return causal(self.buf.pool.index[: self.buf.length], pos, window)[:, None]
