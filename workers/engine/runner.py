"""Static KV caches, batched forwards and CUDA-graph replay for a shard's fixed-size steps.

`Engine(shard, static=..., graphs=...)` is how workers run a shard over sequences' caches:
- dynamic (default on CPU): a growing `KVCache` per sequence, eager forwards, one at a time;
- static: each sequence holds a slot of a preallocated `KVPool`, rolled back in place, and
  `forward_many` runs the steps of several sequences (a round's [last token, drafts], or one drafter
  token each) as one batched forward over their slots;
- static + graphs (default on CUDA): each batched step replays a CUDA graph captured once per
  (pool, batch bucket, step size), with inputs padded to the bucket (rows) and to `step_tokens`
  (with pad=False: one graph per step size, as the drafter uses). Padded tokens sit after a row's
  real ones, so causal masking keeps them out of every real token; padding rows write into the
  pool's pad slot. Sequences beyond the pool's slots get a one-slot pool of their own.
Longer steps (a prompt's prefill) run eagerly over the sequence's slot.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch._dynamo

from schemas.settings import Settings
from workers.engine.kvcache import BatchView, KVCache, KVPool, StaticKVCache
from workers.engine.shard import Cache, Shard
from workers.engine.sizing import attended_lengths, cache_len, cache_modes, fit_slots

Logits = int | Sequence[int]  # rows of logits wanted per sequence (0: hidden states)


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
) -> torch.Tensor:
    """k greedy draft tokens per row [b, k], each fed back on the device: the first from the row's token
    at `pick` after running x, the rest one position further each (capturable as one graph); attention
    over the first `length` positions of each slot (see BatchView)."""
    cur = run(x, pos, BatchView(pool, rows, pos, length), pick)[:, -1].argmax(-1)
    out = [cur]
    last, zero = pos.gather(1, pick), torch.zeros_like(pick)
    limit = pool.index.shape[0] - 1  # padding rows stay on their scratch positions
    for _ in range(1, k):
        last = (last + 1).clamp(max=limit)
        cur = run(cur[:, None], last, BatchView(pool, rows, last, length), zero)[:, -1].argmax(-1)
        out.append(cur)
    return torch.stack(out, dim=1)


def _draft_body(
    run: Callable[..., torch.Tensor],
    pool: KVPool,
    rows: torch.Tensor,
    pick: torch.Tensor,
    steps: int,
    length: int | None,
    x: torch.Tensor,
    pos: torch.Tensor,
    _view: BatchView,
    _pick: object,
) -> torch.Tensor:
    return greedy_steps(run, pool, rows, x, pos, pick, steps, length)


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
    ) -> None:
        dev = shard.device
        self.pool = pool
        self.rows = torch.full((b,), pool.pad_slot, dtype=torch.long, device=dev)
        self.x = (
            torch.zeros(b, t, dtype=torch.long, device=dev)
            if shard.embed is not None
            else torch.zeros(b, t, shard.config.hidden_size, dtype=shard.dtype, device=dev)
        )
        self.pad_pos = pool.index[-t:]  # warm-up and capture write only scratch positions of the pad slot
        self.pos = self.pad_pos.expand(b, t).clone()
        self.pick = torch.arange(t - p, t, device=dev).expand(b, p).clone() if p else None
        view = BatchView(pool, self.rows, self.pos, length)
        self.forward = run
        if steps:
            self.pick = torch.full((b, 1), t - 1, dtype=torch.long, device=dev)
            self.forward = partial(_draft_body, run, pool, self.rows, self.pick, steps, length)
        run = self.forward
        with torch.cuda.device(dev):  # capture on the shard's GPU, not the process's current one
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # warm up kernels (and cuBLAS workspaces) outside the capture
                    run(self.x, self.pos, view, self.pick)
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            # A private memory pool: with a shared one, a graph captured later may keep its output in memory
            # an earlier graph uses for intermediates, and replaying that one clobbers the output.
            # Captured on a stream of the shard's GPU: torch.cuda.graph's default capture stream is made once per
            # process, on whichever GPU was current, and a graph of another GPU's work captured there is empty.
            with torch.cuda.graph(self.graph, stream=side, capture_error_mode="thread_local"):
                self.out = run(self.x, self.pos, view, self.pick)

    def __call__(
        self, rows: torch.Tensor, x: torch.Tensor, pos: torch.Tensor, pick: torch.Tensor | None
    ) -> torch.Tensor:
        n = rows.shape[0]
        with torch.cuda.device(self.x.device):
            self.rows[:n].copy_(rows, non_blocking=True)
            self.rows[n:].fill_(self.pool.pad_slot)
            self.x[:n].copy_(x, non_blocking=True)
            self.pos[:n].copy_(pos, non_blocking=True)
            self.pos[n:].copy_(self.pad_pos.expand_as(self.pos[n:]))
            if pick is not None and self.pick is not None:
                self.pick[:n].copy_(pick, non_blocking=True)
            self.graph.replay()
        return self.out[:n]


class Engine:
    """Runs a shard over sequences' caches: dynamic, static (batched), or static with CUDA graphs."""

    def __init__(
        self,
        shard: Shard,
        *,
        static: bool | None = None,
        graphs: bool | None = None,
        max_len: int | None = None,
        step_tokens: int | None = None,
        pad: bool = True,
        slots: int | None = None,
        compile: bool = False,
        max_draft: int = 0,
        settings: Settings | None = None,
    ) -> None:
        """max_len (default settings.static_cache_len, capped by the model's limit): positions a static cache
        holds; step_tokens (default settings.draft_k + 1): tokens a round feeds per sequence; slots (default
        settings.batch_slots, else sized from the device's memory, `fit_slots`, or settings.cpu_slots):
        sequences of one batched forward; max_draft: longest whole-draft graph."""
        settings = settings or Settings()
        step_tokens = settings.draft_k + 1 if step_tokens is None else step_tokens
        cuda = shard.device.type == "cuda"
        self.shard = shard
        self.run_batch = shard.run_batch
        if compile:  # fused kernels from torch.compile, captured in our own graphs (a few compiles)
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            self.run_batch = torch.compile(shard.run_batch)  # shapes seen twice become dynamic
        self.static, self.graphs = cache_modes(shard, static, graphs)
        self.max_len = cache_len(shard, max_len, settings)  # static caches hold this many positions
        if slots is None:  # as settings say, or what the device's memory leaves room for
            slots = settings.batch_slots or (
                fit_slots(shard.device, self.slot_bytes(shard, step_tokens, max_draft), settings)
                if self.static and cuda
                else settings.cpu_slots
            )
        self.step_tokens, self.pad, self.slots = step_tokens, pad, max(slots, 1)
        self.capture_len = settings.graph_capture_len  # graphs of longer attended lengths: at first use
        self.max_draft = max_draft  # longest greedy draft run as one graph (`draft_many`)
        self._buckets = buckets(self.slots)
        self._graphs: dict[tuple[int, int, int, int, int], BatchGraph] = {}
        self.pool = self._new_pool(self.slots) if self.static else None
        self._spare: list[KVPool] = []  # one-slot pools for sequences beyond the main pool

    def slot_bytes(self, shard: Shard, step_tokens: int, max_draft: int) -> int:
        """Bytes a slot of this engine's pool takes."""
        return KVPool.slot_bytes(shard, self.max_len, step_tokens + max_draft)

    def _new_pool(self, slots: int) -> KVPool:
        scratch = self.step_tokens + self.max_draft  # a draft's extra steps may run past max_len
        return KVPool.for_shard(self.shard, slots=slots, max_len=self.max_len, scratch=scratch)

    def acquire(self, overflow: bool = True) -> Cache | None:
        """A cache for one sequence: a slot of the pool (or, with `overflow`, of a one-slot spare pool), or a
        dynamic cache; None when the pool is full and `overflow` is off."""
        if self.pool is None:
            return KVCache()
        cache = self.pool.acquire()
        if cache is None and not overflow:
            return None
        if cache is None:
            try:
                cache = self._spare.pop().acquire()  # list.pop is atomic for threads sharing the engine
            except IndexError:
                cache = self._new_pool(1).acquire()
        assert cache is not None
        return cache

    def release(self, cache: Cache) -> None:
        """Return a sequence's cache; static slots (and their captured graphs) serve the next sequence.
        At most `slots` one-slot spare pools are kept; others are freed with their graphs."""
        if isinstance(cache, StaticKVCache):
            cache.pool.release(cache)
            if cache.pool is self.pool:
                return
            if len(self._spare) < self.slots:
                self._spare.append(cache.pool)
            else:
                for key in [k for k in self._graphs if k[0] == id(cache.pool)]:
                    del self._graphs[key]

    def forward(self, cache: Cache, x: torch.Tensor, start: int, logits_last: int = 0) -> torch.Tensor:
        """Like `shard(x, start, cache, logits_last)`, through a captured graph when one applies."""
        return self.forward_many([cache], [x], [start], logits_last)[0]

    def forward_many(
        self, caches: Sequence[Cache], xs: Sequence[torch.Tensor], starts: Sequence[int], logits_last: Logits = 0
    ) -> list[torch.Tensor]:
        """Run one step of each sequence: x [m] ids (or [m, h]) at positions start..start+m-1 of its cache.

        Returns per sequence its hidden states [m, h], or the logits [n, vocab] of its last n rows
        (n = logits_last, one int or one per sequence). Static caches of one pool run as one batch."""
        n = len(caches)
        wants = [logits_last] * n if isinstance(logits_last, int) else list(logits_last)
        for cache, x, start in zip(caches, xs, starts, strict=True):  # check every row before any runs
            self.check(cache, start, x.shape[0])
        out: list[torch.Tensor | None] = [None] * n
        groups: dict[int, list[int]] = {}
        for i, (cache, x) in enumerate(zip(caches, xs, strict=True)):
            if isinstance(cache, StaticKVCache) and 0 < x.shape[0] <= self.step_tokens:
                groups.setdefault(id(cache.pool), []).append(i)
            else:
                out[i] = self.shard(x, starts[i], cache, wants[i])
        for idx in groups.values():
            for at in range(0, len(idx), self.slots):
                part = idx[at : at + self.slots]
                got = self._batch(
                    [caches[i] for i in part],  # type: ignore[misc]
                    [xs[i] for i in part],
                    [starts[i] for i in part],
                    [wants[i] for i in part],
                )
                for i, o in zip(part, got, strict=True):
                    out[i] = o
        return out  # type: ignore[return-value]

    def check(self, cache: Cache, start: int, m: int) -> None:
        """Raise ValueError unless `cache` holds exactly `start` positions and has room for m more."""
        if cache.length != start:
            raise ValueError(f"cache holds {cache.length} positions, round starts at {start}")
        if isinstance(cache, StaticKVCache) and start + m > self.max_len:
            raise ValueError(f"sequence of {start + m} positions exceeds the static cache of {self.max_len}")

    def _batch(
        self, caches: list[StaticKVCache], xs: list[torch.Tensor], starts: list[int], wants: list[int]
    ) -> list[torch.Tensor]:
        dev, pool = self.shard.device, caches[0].pool
        sizes = [x.shape[0] for x in xs]
        t = self.step_tokens if self.graphs and self.pad else max(sizes)
        p = 0 if max(wants) == 0 else (1 if max(wants) == 1 else t)
        length = self.attended(pool, max(s + m for s, m in zip(starts, sizes, strict=True)))
        if min(sizes) == t:
            x = torch.stack(list(xs))
        else:
            x = xs[0].new_zeros((len(xs), t, *xs[0].shape[1:]))
            for b, xb in enumerate(xs):
                x[b, : sizes[b]] = xb
        meta = [
            [c.slot, *range(s, s + t), *([m - 1] if p == 1 else range(t - p, t))]
            for c, s, m in zip(caches, starts, sizes, strict=True)
        ]
        meta_t = torch.tensor(meta, dtype=torch.long).to(dev, non_blocking=True)
        rows, pos, pick = meta_t[:, 0], meta_t[:, 1 : 1 + t], (meta_t[:, 1 + t :] if p else None)
        if self.graphs:
            out = self._graph(pool, len(caches), t, p, length=length)(rows, x, pos, pick)
        else:
            out = self.run_batch(x, pos, BatchView(pool, rows, pos, length), pick)
        for cache, start, m in zip(caches, starts, sizes, strict=True):
            cache.advance(start + m)
        if p == 0:
            return [out[b, :m] for b, m in enumerate(sizes)]
        if p == 1:
            return [out[b] for b in range(len(sizes))]
        return [out[b, m - w : m] for b, (m, w) in enumerate(zip(sizes, wants, strict=True))]

    def draft_many(
        self, caches: Sequence[Cache], feeds: Sequence[list[int]], starts: Sequence[int], ks: Sequence[int]
    ) -> torch.Tensor | None:
        """Greedy drafts [n, >= max(ks)] (device; row b's first ks[b] are its own) of sequences of one pool,
        each from its feed of new token ids at start..: one graph replay for all steps, one host-to-device copy
        for all inputs. Caches then hold feed + the first k-1 drafts of their own k.
        None (nothing run) where this does not apply: dynamic caches, several pools, long feeds or drafts.
        Without graphs (static caches on CPU, say) the same steps run eagerly."""
        # every whole draft is max_draft long (rows keep their own k): adaptive K changes k from round to round,
        # and a graph per (batch, feed, k) would mean a capture in most of a job's first rounds and a private
        # memory pool per k (a few spare draft steps cost far less)
        k = self.max_draft
        pool = getattr(caches[0], "pool", None)
        sizes = [len(f) for f in feeds]
        if (
            not self.static
            or max(ks) > self.max_draft
            or min(ks) < 1
            or len(caches) > self.slots
            or max(sizes) > self.step_tokens
        ):
            return None
        if not all(isinstance(c, StaticKVCache) and c.pool is pool for c in caches) or min(sizes) < 1:
            return None
        for cache, start, m, kb in zip(caches, starts, sizes, ks, strict=True):
            self.check(cache, start, m + kb - 1)  # keys of drafts past a row's own k land in the pool's scratch
        t = max(sizes)
        meta = [
            [c.slot, *range(s, s + t), len(f) - 1, *f, *[0] * (t - len(f))]
            for c, s, f in zip(caches, starts, feeds, strict=True)
        ]
        meta_t = torch.tensor(meta, dtype=torch.long).to(self.shard.device, non_blocking=True)
        rows, pos, pick, x = meta_t[:, 0], meta_t[:, 1 : 1 + t], meta_t[:, 1 + t : 2 + t], meta_t[:, 2 + t :]
        length = self.attended(pool, max(s + m + k - 1 for s, m in zip(starts, sizes, strict=True)))  # type: ignore[arg-type]
        if self.graphs:
            out = self._graph(pool, len(caches), t, 1, steps=k, length=length)(rows, x, pos, pick)  # type: ignore[arg-type]
        else:
            out = greedy_steps(self.run_batch, pool, rows, x, pos, pick, k, length)  # type: ignore[arg-type]
        for cache, start, m, kb in zip(caches, starts, sizes, ks, strict=True):
            cache.advance(start + m + kb - 1)  # type: ignore[union-attr]
        return out

    def capture(self, shapes: Sequence[tuple[int, int, int]]) -> int:
        """Capture, for every batch bucket of the pool and every attended length up to capture_len, the
        graphs of these (tokens, picked rows, draft steps) shapes now rather than at their first use (a
        capture takes tens of milliseconds, and the first jobs of a worker would pay for dozens); the number
        of graphs captured. Nothing without CUDA graphs."""
        if not self.graphs or self.pool is None:
            return 0
        before = len(self._graphs)
        lengths = [n for n in attended_lengths(self.pool) if n <= self.capture_len] or attended_lengths(self.pool)[:1]
        with torch.inference_mode():  # as rounds run (else autograd would keep every intermediate alive)
            for size in self._buckets:
                for t, p, steps in shapes:
                    for n in lengths:
                        self._graph(self.pool, size, t, p, steps, n)
        return len(self._graphs) - before

    @staticmethod
    def attended(pool: KVPool, need: int) -> int:
        """The attended length of a batch whose rows use positions below `need`: the smallest of
        `attended_lengths` that holds them (a few lengths, so a few graphs per shape)."""
        return next((n for n in attended_lengths(pool) if n >= need), pool.index.shape[0])

    def _graph(self, pool: KVPool, b: int, t: int, p: int, steps: int = 0, length: int | None = None) -> BatchGraph:
        size = next(s for s in self._buckets if s >= b) if pool is self.pool else 1
        key = (id(pool), size, t, p, steps, length)
        graph = self._graphs.get(key)
        if graph is None:
            graph = BatchGraph(self.shard, self.run_batch, pool, size, t, p, steps, length)
            self._graphs[key] = graph
        return graph
