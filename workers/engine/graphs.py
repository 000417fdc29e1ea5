"""CUDA graphs of an engine's fixed-size batched steps, and the memory they share.

`BatchGraph` captures one forward of b rows x t tokens over a `KVPool` (or a whole greedy draft,
`greedy_steps`) and replays it with new inputs copied into its static input tensors. All graphs of one
engine capture into one memory pool (`GraphMemory`): a replay's intermediates are dead once it ends, so
they can share memory, and the engine needs about what its largest graph needs, not the sum of every
graph's (private pools per graph held 16 GB on a 7B half's tail with 256 slots). Each graph copies its
result into an output buffer outside the pool, one per (tokens, picked rows, draft steps) shared by the
engine's graphs: a result stays valid until the engine's next replay, so callers use it (or copy it) first.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from workers.engine.draft_buffer import DraftBuffer, DraftStep
from workers.engine.kvcache import BatchView, KVPool
from workers.engine.shard import Shard, blank_input


class GraphMemory:
    """What one engine's graphs share: the memory pool they capture into and their output buffers, each
    sized for `rows` (the engine's largest batch)."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self._pool: tuple[int, int] | None = None
        self._stream: torch.cuda.Stream | None = None
        self._outs: dict[tuple, torch.Tensor] = {}

    def pool(self) -> tuple[int, int]:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def stream(self) -> torch.cuda.Stream:
        """The one stream every capture runs on (call under the device): the caching allocator reuses a freed
        block only for allocations on the stream it was made on, so captures on streams of their own would
        never reuse each other's memory."""
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

    def out(self, key: tuple, like: torch.Tensor) -> torch.Tensor:
        """The first like.shape[0] rows of the buffer for results shaped like `like` (made outside the pool)."""
        key = (*key, like.dtype, *like.shape[1:])
        buf = self._outs.get(key)
        if buf is None or buf.shape[0] < like.shape[0]:
            buf = self._outs[key] = like.new_empty((max(self.rows, like.shape[0]), *like.shape[1:]))
        return buf[: like.shape[0]]

    @property
    def output_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._outs.values())


def buckets(limit: int) -> list[int]:
    """Batch sizes graphs are captured for: powers of two up to `limit`, and `limit` itself."""
    out = [1]
    while out[-1] * 2 < limit:
        out.append(out[-1] * 2)
    return sorted({*out, limit})


def greedy_steps(
    run: Callable[..., torch.Tensor],
    pool: KVPool,
    rows: torch.Tensor,
    x: torch.Tensor,
    pos: torch.Tensor,
    pick: torch.Tensor,
    k: int,
    length: int | None = None,
    in_place: bool = False,
) -> torch.Tensor:
    """k greedy draft tokens per row [b, k], each fed back on the device: the first from the row's token
    at `pick` after running x, the rest one position further each (capturable as one graph). With `in_place`
    (a shard whose attention reads the pool where it is, workers/engine/pool_attention.py) every step runs over
    the pool itself; else attention is over the first `length` positions of each slot, copied out of the pool
    once for all k steps and the positions written copied back at the end (`DraftBuffer`)."""
    buf = None if in_place else DraftBuffer(pool, rows, length)

    def view(p: torch.Tensor) -> BatchView | DraftStep:
        return BatchView(pool, rows, p, length) if buf is None else buf.view(p)

    cur = run(x, pos, view(pos), pick)[:, -1].argmax(-1)
    out, written = [cur], [pos]
    last, zero = pos.gather(1, pick), torch.zeros_like(pick)
    limit = pool.index.shape[0] - 1  # padding rows stay on their scratch positions
    for _ in range(1, k):
        last = (last + 1).clamp(max=limit)
        cur = run(cur[:, None], last, view(last), zero)[:, -1].argmax(-1)
        out.append(cur)
        written.append(last)
    if buf is not None:
        buf.write_back(torch.cat(written, dim=1))
    return torch.stack(out, dim=1)


def _draft_body(
    run: Callable[..., torch.Tensor],
    pool: KVPool,
    rows: torch.Tensor,
    pick: torch.Tensor,
    steps: int,
    length: int | None,
    in_place: bool,
    x: torch.Tensor,
    pos: torch.Tensor,
    _view: BatchView,
    _pick: object,
) -> torch.Tensor:
    return greedy_steps(run, pool, rows, x, pos, pick, steps, length, in_place)


def _with_ids(run: Callable[..., torch.Tensor], ids: torch.Tensor, *args: object) -> torch.Tensor:
    return run(*args, ids=ids)  # a captured forward of a shard that takes its rows' ids (Gemma 4's tail)


class BatchGraph:
    """One captured forward of `b` rows × `t` tokens over one pool (logits of `p` rows each, or hidden),
    or with `steps` > 0 a whole greedy draft of that many tokens (`greedy_steps`; p = 1), attending over
    the first `length` positions of each slot (None: all)."""

    def __init__(
        self,
        shard: Shard,
        run: Callable[..., torch.Tensor],
        pool: KVPool,
        b: int,
        t: int,
        p: int,
        steps: int = 0,
        length: int | None = None,
        memory: GraphMemory | None = None,
    ) -> None:
        dev = shard.device
        self.pool = pool
        self.rows = torch.full((b,), pool.pad_slot, dtype=torch.long, device=dev)
        self.x = blank_input(shard, b, t)
        self.pad_pos = pool.index[-t:]  # warm-up and capture write only scratch positions of the pad slot
        self.pos = self.pad_pos.expand(b, t).clone()
        self.pick = torch.arange(t - p, t, device=dev).expand(b, p).clone() if p else None
        view = BatchView(pool, self.rows, self.pos, length)
        self.ids = torch.zeros(b, t, dtype=torch.long, device=dev) if shard.needs_ids else None  # a Gemma 4 tail's
        if self.ids is not None:
            run = partial(_with_ids, run, self.ids)
        self.forward = run
        if steps:
            self.pick = torch.full((b, 1), t - 1, dtype=torch.long, device=dev)
            self.forward = partial(_draft_body, run, pool, self.rows, self.pick, steps, length, shard.attends_in_place)
        run = self.forward
        with torch.cuda.device(dev):  # capture on the shard's GPU, not the process's current one
            memory = memory or GraphMemory(b)
            side = memory.stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # warm up kernels (and cuBLAS workspaces) outside the capture
                    warm = run(self.x, self.pos, view, self.pick)
            torch.cuda.current_stream().wait_stream(side)
            self.out = memory.out((t, p, steps), warm)  # outside the pool: no later capture reuses it
            del warm
            self.graph = torch.cuda.CUDAGraph()
            # Captured on a stream of the shard's GPU: torch.cuda.graph's default capture stream is made once per
            # process, on whichever GPU was current, and a graph of another GPU's work captured there is empty.
            with torch.cuda.graph(self.graph, pool=memory.pool(), stream=side, capture_error_mode="thread_local"):
                self.out.copy_(run(self.x, self.pos, view, self.pick))

    def __call__(
        self,
        rows: torch.Tensor,
        x: torch.Tensor,
        pos: torch.Tensor,
        pick: torch.Tensor | None,
        ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        n = rows.shape[0]
        with torch.cuda.device(self.x.device):
            if self.ids is not None:  # the rows' token ids (padding rows: 0); never the last replay's
                assert ids is not None, "this shard's captured forward takes its rows' token ids"
                self.ids[:n].copy_(ids, non_blocking=True)
                self.ids[n:].zero_()
            self.rows[:n].copy_(rows, non_blocking=True)
            self.rows[n:].fill_(self.pool.pad_slot)
            self.x[:n].copy_(x, non_blocking=True)
            self.pos[:n].copy_(pos, non_blocking=True)
            self.pos[n:].copy_(self.pad_pos.expand_as(self.pos[n:]))
            if pick is not None and self.pick is not None:
                self.pick[:n].copy_(pick, non_blocking=True)
            self.graph.replay()
        return self.out[:n]
