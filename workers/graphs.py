"""Static KV caches and CUDA-graph replay for a shard's fixed-size steps.

`Engine(shard, static=..., graphs=...)` is how workers run a shard over a sequence's cache:
- dynamic (default on CPU): a growing `KVCache`, eager forwards;
- static: a preallocated `StaticKVCache` per sequence, rolled back in place;
- static + graphs (default on CUDA): every step of at most `step_tokens` tokens (a round's
  [last token, drafts], or one drafter token) replays a CUDA graph captured once per cache, with
  inputs padded to `step_tokens` (with pad=False: one graph per step size, as the drafter uses).
  Padded rows sit after the real ones, so causal masking keeps them out of every real row; the
  slots they write lie past the committed length and are overwritten later.
Longer steps (a prompt's prefill) run eagerly over the same cache.
"""

from __future__ import annotations

import weakref

import torch

from workers.kvcache import KVCache, StaticKVCache
from workers.shard import Cache, Shard


class StepGraph:
    """One captured forward of `n` rows over one static cache."""

    def __init__(self, shard: Shard, cache: StaticKVCache, n: int, with_logits: bool, pool: object) -> None:
        dev = shard.device
        self.n, self.cache = n, cache
        self.x = (
            torch.zeros(n, dtype=torch.long, device=dev)
            if shard.embed is not None
            else torch.zeros(n, shard.config.hidden_size, dtype=shard.dtype, device=dev)
        )
        # Warm-up and capture write their (garbage) keys/values into the cache's slack slots past max_len,
        # never into a prefix the cache may already hold.
        self.pos = torch.arange(cache.max_len - n, cache.max_len, device=dev)
        logits = n if with_logits else 0
        with torch.cuda.device(dev):  # capture on the shard's GPU, not the process's current one
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # warm up kernels (and cuBLAS workspaces) outside the capture
                    shard.run(self.x, self.pos, cache, logits)
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
                self.out = shard.run(self.x, self.pos, cache, logits)

    def __call__(self, x: torch.Tensor, start: int) -> torch.Tensor:
        m = x.shape[0]
        with torch.cuda.device(self.x.device):
            self.x[:m].copy_(x, non_blocking=True)
            self.pos.copy_(self.cache.positions(start, self.n, self.x.device))
            self.graph.replay()
        self.cache.advance(start + m)
        return self.out


class Engine:
    """Runs a shard over per-sequence caches: dynamic, static, or static with CUDA graphs."""

    def __init__(
        self,
        shard: Shard,
        *,
        static: bool | None = None,
        graphs: bool | None = None,
        max_len: int | None = None,
        step_tokens: int = 9,
        pad: bool = True,
    ) -> None:
        cuda = shard.device.type == "cuda"
        self.shard = shard
        self.graphs = cuda if graphs is None else graphs
        if self.graphs and not cuda:
            raise ValueError("CUDA graphs need a CUDA device")
        self.static = self.graphs or (cuda if static is None else static)
        limit = getattr(shard.config, "max_position_embeddings", None) or 8192
        self.max_len = min(max_len or 8192, limit)  # static caches hold this many positions
        self.step_tokens, self.pad = step_tokens, pad
        self._graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        if self.graphs:
            with torch.cuda.device(shard.device):
                self._pool = torch.cuda.graph_pool_handle()
        else:
            self._pool = None
        self._free: list[StaticKVCache] = []

    def new_cache(self) -> Cache:
        if not self.static:
            return KVCache()
        return StaticKVCache.for_shard(self.shard, self.max_len + self.step_tokens)

    def acquire(self) -> Cache:
        """A cache for one sequence: a released static cache (its captured graphs reused) or a new one."""
        try:
            return self._free.pop()  # atomic, so threads sharing the engine never get the same cache
        except IndexError:
            return self.new_cache()

    def release(self, cache: Cache) -> None:
        """Return a sequence's cache; static ones are kept for the next sequence."""
        if isinstance(cache, StaticKVCache):
            cache.crop(0)
            self._free.append(cache)

    def forward(self, cache: Cache, x: torch.Tensor, start: int, logits_last: int = 0) -> torch.Tensor:
        """Like `shard(x, start, cache, logits_last)`, through a captured graph when one applies."""
        m = x.shape[0]
        if not (self.graphs and isinstance(cache, StaticKVCache) and m <= self.step_tokens):
            return self.shard(x, start, cache, logits_last)
        if cache.length != start:
            raise ValueError(f"cache holds {cache.length} positions, round starts at {start}")
        if start + m > self.max_len:
            raise ValueError(f"sequence of {start + m} positions exceeds the static cache of {self.max_len}")
        per_cache = self._graphs.setdefault(cache, {})
        n = self.step_tokens if self.pad else m
        key = (n, logits_last > 0)
        if key not in per_cache:
            per_cache[key] = StepGraph(self.shard, cache, n, logits_last > 0, self._pool)
        out = per_cache[key](x, start)
        return out[m - logits_last : m] if logits_last > 0 else out[:m]
