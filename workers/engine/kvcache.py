"""Per-sequence KV caches for a slice of layers, with exact rollback to a committed prefix.

Decoder layers call `update(keys, values, layer_idx)` and attend over what it returns. Layers are
keyed by their global index, so a tail's cache simply has no entries for the head's layers.

- `KVCache` grows by concatenation (any length; eager).
- `StaticKVCache` is one slot of a preallocated `KVPool` ([slots + 1, kv_heads, L, head_dim] per
  layer) and writes each step at device-side positions, so a forward over it can be captured in a
  CUDA graph; rollback is setting the length, in place (stale entries past it are masked out and
  later overwritten). A `BatchView` runs several slots of a pool as one batched forward.

A released slot is zeroed (in place: the tensors captured graphs read stay the same). Masking alone does not
keep stale entries out of attention's output: a masked probability of 0 times a NaN value is NaN (and a NaN
key's score stays NaN under a -inf bias), so one sequence's non-finite keys/values, forged or a real float16
overflow, would fail every later sequence of its slot. Zeroed, what a slot holds past its length is only the
current sequence's own (finite while its outputs are: its rows attend to them, masked). One memset per
layer per release costs far less than masking keys/values in every round (bench/slot_hygiene.py, removed: git history
before 92894f6).

Both answer `positions(start, n)` and `mask(pos, window)` so a shard builds its attention mask the same way (a
window: each query sees only the last `window` positions up to its own, as HF's sliding-window layers do).

A windowed layer keeps a ring of its window and some slack rather than every position (workers/engine/rings.py),
where the engine's settings give a slack (`engine.window_slack`). A whole draft's K steps run over a copy of the
batch's rows (workers/engine/draft_buffer.py).
"""

from __future__ import annotations

from typing import Any

import torch

from workers.engine.layouts import pool_dims, slot_length
from workers.engine.linear_pool import LinearStates, View, furthest_base, linear_modules, rollback_error
from workers.engine.rings import is_long, ring_mask, ring_sizes, shard_windows, write_ring


def causal(index: torch.Tensor, pos: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """[..., T, L]: whether query t (at position pos[..., t]) sees key column l (at position index[l]): at or
    before its own position and, with a window, after pos - window (HF's `sliding_window_overlay`)."""
    q = pos[..., None]
    ok = index <= q
    return ok & (index > q - window) if window is not None else ok


class KVCache:
    """Keys and values of one sequence for the layers of one shard (grows as needed)."""

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

    def positions(self, start: int, n: int, device: torch.device) -> torch.Tensor:
        return torch.arange(start, start + n, device=device)

    def mask(self, pos: torch.Tensor, window: int | None = None) -> torch.Tensor | None:
        n, total = pos.shape[0], self.length + pos.shape[0]
        if n == 1 and (window is None or total <= window):
            return None
        return causal(torch.arange(total, device=pos.device), pos, window)[None, None]

    def crop(self, length: int) -> None:
        """Keep only the first `length` positions (rollback to a committed prefix)."""
        if length < 0 or length > self.length:
            raise ValueError(f"cannot crop a cache of {self.length} positions to {length}")
        for idx in self.keys:
            self.keys[idx] = self.keys[idx][..., :length, :]
            self.values[idx] = self.values[idx][..., :length, :]


class KVPool:
    """Static keys/values for `slots` sequences, [slots + 1, kv_heads, max_len + scratch, key / value width] per
    layer. Each sequence owns one slot (a `StaticKVCache` view); the extra slot and the `scratch`
    positions past max_len take the writes of padding rows, so batches of any size up to `slots` run
    as one fixed-shape (graph-capturable) forward. A one-slot pool has no extra slot.

    With `ring_slack`, a layer of `windows` (layer -> its sliding window) keeps [slots + 1, kv_heads, R, width],
    R = window + ring_slack rounded up (workers/engine/rings.py), where that is shorter than a slot; with `linear`
    (layer -> its linear-attention mixer), their states and last scratch + 1 inputs (workers/engine/linear_pool.py).
    `dims` (layer -> heads, key width, value width; `pool_dims`): each layer's own, where they vary."""

    def __init__(
        self,
        layer_ids: list[int],
        kv_heads: int,
        head_dim: int,
        *,
        value_dim: int | None = None,
        slots: int,
        max_len: int,
        scratch: int,
        dtype: torch.dtype,
        device: torch.device | str,
        windows: dict[int, int] | None = None,
        ring_slack: int | None = None,
        linear: dict[int, Any] | None = None,
        dims: dict[int, tuple[int, int, int]] | None = None,
    ) -> None:
        dims = dims or dict.fromkeys(layer_ids, (kv_heads, head_dim, value_dim or head_dim))
        depth = scratch + 1  # how far back a linear layer's states roll
        scratch = slot_length(max_len, scratch) - max_len  # total length a multiple of 16 (kernel alignment)
        self.ring_slack = ring_slack
        self.rings = ring_sizes(windows or {}, ring_slack, max_len + scratch)  # layer -> (ring, window)
        self.ring_of = {w: r for r, w in self.rings.values()}  # window -> ring
        self.ring_shapes = sorted(set(self.rings.values()))  # the distinct (ring, window) pairs (`StaticKVCache.high`)
        # A one-slot pool never has padding rows: warm-up and capture write its own slot's scratch positions. Not
        # where a ring keeps a layer: its scratch positions wrap onto live ones (p mod R), so it has a pad slot too.
        padded = slots > 1 or bool(self.rings) or bool(linear)
        self.pad_slot = slots if padded else 0
        self.padding = self.pad_slot if padded else None  # the slot only padding rows use, if there is one
        rows = slots + padded

        shape = {i: (rows, dims[i][0], self.length_of(i, max_len + scratch)) for i in layer_ids}
        self.keys = {i: torch.zeros(*shape[i], dims[i][1], dtype=dtype, device=device) for i in layer_ids}
        self.values = {i: torch.zeros(*shape[i], dims[i][2], dtype=dtype, device=device) for i in layer_ids}
        self.linear = LinearStates(linear, rows, depth, dtype, device) if linear else None
        self.slots, self.max_len, self.scratch = slots, max_len, scratch
        self.index = torch.arange(max_len + scratch, device=device)
        self._free = list(range(slots - 1, -1, -1))
        self._copies: tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]] | None = None

    def draft_copies(self) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]] | None:
        """On CUDA, storage as large as the pool's keys and values (made at first use) that every whole draft's
        `DraftBuffer` copies its rows into: one copy for all of them, as the memory plan counts it. Copies made
        apart took as much again in the graph pool as in warm-up (a Qwen3-8B head ran out of memory capturing
        its drafter's graphs; docs/runs/journal.md, run 73). None on a CPU: each draft takes its own."""
        first = next(iter(self.keys.values()), None)
        if first is None or first.device.type != "cuda":
            return None
        if self._copies is None:
            self._copies = tuple(
                {i: torch.empty(t.numel(), dtype=t.dtype, device=t.device) for i, t in part.items()}
                for part in (self.keys, self.values)
            )  # type: ignore[assignment]
        return self._copies

    def length_of(self, layer: int, full: int) -> int:
        """Positions layer `layer` keeps a slot: its ring's, or `full`."""
        return self.rings[layer][0] if layer in self.rings else full

    @staticmethod
    def slot_bytes(shard: Any, max_len: int, scratch: int, ring_slack: int | None = None) -> int:
        """Bytes one slot of a pool for `shard` takes (keys and values of every layer; rings where windowed)."""
        dims = pool_dims(shard)
        length = slot_length(max_len, scratch)
        rings = ring_sizes(shard_windows(shard), ring_slack, length)
        size = torch.empty((), dtype=shard.dtype).element_size()
        states = LinearStates.slot_bytes(linear_modules(shard.layers), scratch + 1, size)
        return states + sum(h * (k + v) * rings.get(i, (length, 0))[0] * size for i, (h, k, v) in dims.items())

    @classmethod
    def for_shard(cls, shard: Any, *, slots: int, max_len: int, scratch: int, ring_slack: int | None = None) -> KVPool:
        dims = pool_dims(shard)
        return cls(
            list(dims),
            0,
            0,
            slots=slots,
            max_len=max_len,
            scratch=scratch,
            dtype=shard.dtype,
            device=shard.device,
            windows={i: w for i, w in shard_windows(shard).items() if i in dims},
            ring_slack=ring_slack,
            linear=linear_modules(shard.layers),
            dims=dims,
        )

    @property
    def free(self) -> int:
        return len(self._free)

    def acquire(self) -> StaticKVCache | None:
        """A free slot's cache, or None when every slot is taken."""
        try:
            return StaticKVCache(self, self._free.pop())  # atomic: threads never get the same slot
        except IndexError:
            return None

    def release(self, cache: StaticKVCache) -> None:
        """Give a slot back, zeroed: nothing of its last sequence reaches the next one's attention. Once per
        cache (a second release would zero and free a slot another sequence may hold by then)."""
        if cache.released:
            return
        cache.crop(0)
        cache.released = True
        self.clear(cache.slot)
        self._free.append(cache.slot)

    def clear(self, slot: int) -> None:
        """Zero one slot's keys and values of every layer in place (one memset each; with CUDA graphs on the
        stream they replay on, so a later replay reads the zeros)."""
        kv = [t[slot] for t in (*self.keys.values(), *self.values.values())]
        torch._foreach_zero_([*kv, *(self.linear.slot_tensors(slot) if self.linear is not None else [])])


class StaticKVCache:
    """One sequence's slot of a `KVPool`: graph-capturable writes at device positions; in-place rollback."""

    def __init__(self, pool: KVPool, slot: int) -> None:
        self.pool, self.slot = pool, slot
        self.keys = {i: k[slot : slot + 1] for i, k in pool.keys.items()}
        self.values = {i: v[slot : slot + 1] for i, v in pool.values.items()}
        self.max_len = pool.max_len
        self._length = 0
        self.pos: torch.Tensor | None = None  # positions of the step being run (device)
        self.released = False  # given back to the pool (`KVPool.release`)
        self.slot_row = torch.full((1,), slot, dtype=torch.long, device=pool.index.device)
        self.high: dict[tuple[int, int], int] = {}  # (ring, window) -> one past the furthest position written there
        self.linear_base = 0  # the least length its linear layers' states roll back to (linear_pool.py)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *_: Any, **__: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's keys/values at `self.pos`; return the whole (masked) buffers (a ring's: see
        `write_ring`)."""
        if layer_idx in self.pool.rings:
            assert self.pos is not None, "mask(pos) first"
            slot = self.slot
            return write_ring(
                self.pool,
                layer_idx,
                self.slot_row[:, None],
                self.pos[None],
                None,
                key_states,
                value_states,
                lambda t: t[slot : slot + 1],
            )
        k, v = self.keys[layer_idx], self.values[layer_idx]
        k.index_copy_(2, self.pos, key_states)  # type: ignore[arg-type]
        v.index_copy_(2, self.pos, value_states)  # type: ignore[arg-type]
        return k, v

    def write(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's keys/values at `self.pos`; the layer's pool tensors (every slot)."""
        self.update(key_states, value_states, layer_idx)
        return self.pool.keys[layer_idx], self.pool.values[layer_idx]

    def in_place(self) -> tuple[KVPool, torch.Tensor, torch.Tensor, int]:
        """As `BatchView.in_place`, for this one sequence (its positions: those of the step being run)."""
        assert self.pos is not None, "mask(pos) first"
        return self.pool, self.slot_row, self.pos[-1:], self.pool.index.shape[0]

    def linear_view(self) -> View:  # what a linear layer's pooled forward reads (workers/engine/linear_pool.py)
        assert self.pool.linear is not None and self.pos is not None, "mask(pos) first"
        return self.pool.linear, self.slot_row, self.pos[None], None

    def get_seq_length(self, layer_idx: int | None = None) -> int:
        return self._length

    @property
    def length(self) -> int:
        return self._length

    def positions(self, start: int, n: int, device: torch.device) -> torch.Tensor:
        if start + n > self.max_len:
            raise ValueError(f"sequence of {start + n} positions exceeds the static cache of {self.max_len}")
        return self.pool.index[start : start + n]

    def mask(self, pos: torch.Tensor, window: int | None = None) -> torch.Tensor:
        """Query i attends to every cached slot at or before its position (valid prefix + itself)."""
        self.pos = pos
        if window in self.pool.ring_of:
            return ring_mask(pos, self.pool.ring_of[window], window)[None, None]
        return causal(self.pool.index, pos, window)[None, None]

    def advance(self, length: int, written: int = 0) -> None:
        """The cache held `self.length` positions before a step and holds `length` after it; `written`: one past
        the furthest position the step wrote, padding included (default: length). A ring keeps what its step wrote
        (`high`), except the padding of a step too long for it (rings.long_writes writes real positions only)."""
        steps = max(written, length) - self._length
        for ring, window in self.pool.ring_shapes:
            top = length if is_long(steps, ring, window) else max(written, length)
            self.high[ring, window] = max(self.high.get((ring, window), 0), top)
        if self.pool.linear is not None:
            self.linear_base = furthest_base(self.linear_base, max(written, length), self.pool.linear.depth)
        self._length = length

    def crop(self, length: int) -> None:
        """Roll back to the first `length` positions. A ring (rings.py) reads a position s it holds beyond the
        sequence as s - R, outside every window of a later query while s < length + R - W + 1: a rollback further
        back from the furthest position written there is refused."""
        if length < 0 or length > self._length:
            raise ValueError(f"cannot crop a cache of {self._length} positions to {length}")
        for (ring, window), high in self.high.items():
            if length and high - length > ring - window + 1:
                raise ValueError(
                    f"cannot roll a windowed layer's ring back from position {high} to {length}: it keeps "
                    f"{ring - window} positions beyond its window (engine.window_slack)"
                )
        linear = self.pool.linear
        if linear is not None and 0 < length < self.linear_base:
            raise rollback_error(length, self.linear_base, linear.depth)
        self._length = length
        if length == 0:  # a replay from 0 rewrites 0..P in order; a slot not yet rewritten reads as a negative position
            self.high.clear()
            if linear is not None and self.linear_base:  # and linear layers start from nothing
                linear.clear(self.slot)
            self.linear_base = 0


class BatchView:
    """Several slots of one pool as the cache of one batched forward: row b is slot rows[b] and its
    tokens sit at positions pos[b] (padding rows use the pool's pad slot and scratch positions).
    Attention reads only the first `length` positions of each slot (default: all): a batch whose rows
    all sit below it gathers and attends over what its sequences use, not the pool's capacity."""

    def __init__(
        self,
        pool: KVPool,
        rows: torch.Tensor,
        pos: torch.Tensor,
        length: int | None = None,
        last: torch.Tensor | None = None,
    ) -> None:
        self.pool, self.rows, self.pos = pool, rows, pos
        self.length = length or pool.index.shape[0]
        self.last = last  # each row's last real position (padding follows): what a long step keeps in a ring

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *_: Any, **__: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Scatter [B, heads, T, dim] into the rows' slots at their positions; gather the rows' caches (a ring's:
        see `write_ring`)."""
        if layer_idx in self.pool.rings:
            rows = self.rows
            return write_ring(
                self.pool, layer_idx, rows[:, None], self.pos, self.last, key_states, value_states, lambda t: t[rows]
            )
        k, v = self.write(key_states, value_states, layer_idx)
        n = self.length
        return k[:, :, :n][self.rows], v[:, :, :n][self.rows]

    def write(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Scatter [B, heads, T, dim] into the rows' slots at their positions; the layer's pool tensors."""
        k, v = self.pool.keys[layer_idx], self.pool.values[layer_idx]
        slots = self.rows[:, None]
        k[slots, :, self.pos] = key_states.transpose(1, 2)
        v[slots, :, self.pos] = value_states.transpose(1, 2)
        return k, v

    def in_place(self) -> tuple[KVPool, torch.Tensor, torch.Tensor, int]:
        """(pool, slot of each row, position of each row's last token, the attended length: no real row reads keys
        past it): what attention over the pool in place reads (workers/engine/pool_attention.py)."""
        return self.pool, self.rows, self.pos[:, -1], self.length

    def linear_view(self) -> View:  # what a linear layer's pooled forward reads (workers/engine/linear_pool.py)
        assert self.pool.linear is not None
        return self.pool.linear, self.rows, self.pos, self.last

    def get_seq_length(self, layer_idx: int | None = None) -> int:
        return 0

    def mask(self, pos: torch.Tensor, window: int | None = None) -> torch.Tensor:
        """[B, 1, T, length]: each row's token attends to its slot's positions at or before its own (a ring's
        columns where the window has one)."""
        if window in self.pool.ring_of:
            return ring_mask(pos, self.pool.ring_of[window], window)[:, None]
        return causal(self.pool.index[: self.length], pos, window)[:, None]
