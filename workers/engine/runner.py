"""Static KV caches, batched forwards and CUDA-graph replay for a shard's fixed-size steps.

`Engine(shard, settings)` is how workers run a shard over sequences' caches (settings.engine.static / graphs):
- dynamic (`--dynamic-cache`): a growing `KVCache` per sequence, eager forwards, one at a time;
- static (the default): each sequence holds a slot of a preallocated `KVPool`, rolled back in place, and
  `forward_many` runs the steps of several sequences (a round's [last token, drafts], or one drafter
  token each) as one batched forward over their slots;
- static + graphs (default on CUDA): each batched step replays a CUDA graph captured once per
  (pool, batch bucket, step size), with inputs padded to the bucket (rows) and to `step_tokens`
  (with pad=False: one graph per step size, as the drafter uses; workers/engine/graphs.py). Padded tokens sit
  after a row's real ones, so causal masking keeps them out of every real token; padding rows write into the
  pool's pad slot. Sequences beyond the pool's slots get a one-slot pool of their own. A result of a graph stays
  valid until the engine's next replay.
Static slots come in two lengths when sized from memory (`SlotPlan`), each a pool batched apart. Longer steps
(prompts) run as eager batches, padded to their longest, up to `prefill_tokens` tokens each.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial

import torch
import torch._dynamo

from schemas.settings import Settings
from workers.engine import decode_kernels, pool_attention
from workers.engine.batches import check_ids, padded, pick_last, prefill_parts
from workers.engine.graphs import BatchGraph, GraphMemory, buckets, greedy_steps
from workers.engine.kvcache import BatchView, KVPool, StaticKVCache
from workers.engine.shard import Cache, Shard
from workers.engine.sizing import (
    SlotPlan,
    attended_lengths,
    cache_len,
    cache_modes,
    cpu_plan,
    engine_slot_cost,
    memory_plan,
    ring_slack,
    shard_workspace,
)

log = logging.getLogger("shardflow.engine")
GB = 1e9

Logits = int | Sequence[int]  # rows of logits wanted per sequence (0: hidden states)


class Engine:
    """Runs a shard over sequences' caches: dynamic, static (batched), or static with CUDA graphs."""

    def __init__(
        self,
        shard: Shard,
        settings: Settings | None = None,
        *,
        step_tokens: int | None = None,
        pad: bool = True,
        slots: int | SlotPlan | None = None,
        compile: bool = False,
        max_draft: int = 0,
        label: str = "shard",
    ) -> None:
        """`settings.engine` (default: Settings()'s) says how: static caches and graphs, positions a static cache holds
        (max_len, capped by the model's limit), slots, prefill and capture sizes. This engine's own shape: step_tokens
        (default engine.graph_k + 1, never a request's k): tokens a round feeds per sequence through the graphs
        (longer steps run eagerly); slots: sequences of full length, or a `SlotPlan` with short slots too (default:
        engine.slots, else what the device's memory holds, `memory_plan`, or engine.cpu_slots); max_draft: longest
        whole-draft graph (a drafter's engine); label: its name in memory log lines ("head", "draft", "tail")."""
        settings = settings or Settings()
        self.label = label
        step_tokens = settings.engine.graph_k + 1 if step_tokens is None else step_tokens
        self.shard = shard
        shard.set_attention(settings.engine.attention)
        if shard.device.type == "cuda":  # steps as Triton kernels between GEMMs (CPU: tests interpret them)
            shard.set_decode_kernels(*decode_kernels.wanted(settings.engine, drafter=bool(max_draft), compile=compile))
        self.run_batch = shard.run_batch
        if compile:  # fused kernels from torch.compile, captured in our own graphs (a few compiles)
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            self.run_batch = torch.compile(shard.run_batch)  # shapes seen twice become dynamic
        self.static, self.graphs = cache_modes(shard, settings.engine)
        self.max_len = cache_len(shard, settings)  # static caches hold this many positions
        self.step_tokens, self.pad, self.max_draft = step_tokens, pad, max_draft  # max_draft: see `draft_many`
        self.ring_slack = ring_slack(settings, step_tokens, max_draft)  # windowed layers' rings (rings.py)
        plan = slots if isinstance(slots, SlotPlan) else SlotPlan(slots) if slots else self._plan(settings)
        self.slots = max(plan.total, 1)  # sequences held at once (both lengths)
        self.capture_len = settings.engine.graph_capture_len  # graphs of longer attended lengths: at first use
        self.prefill_tokens = settings.engine.prefill_tokens  # padded tokens of one batch of prompts
        self._graphs: dict[tuple[int, int, int, int, int, int | None], BatchGraph] = {}
        self.graph_bytes = 0  # device memory the captures reserved (the pool and the output buffers)
        self.pool = self._new_pool(max(plan.slots, 1)) if self.static else None  # full-length slots
        self.short_pool = self._new_pool(plan.short, plan.short_len) if self.static and plan.short else None
        self.graph_memory = GraphMemory(max(p.slots for p in self.pools) if self.pools else 1)
        self._spare: list[KVPool] = []  # one-slot pools for sequences beyond the main pools

    def _plan(self, settings: Settings) -> SlotPlan:
        """Slots as settings say, or from the device's memory (full-length and short ones), or cpu_slots."""
        if self.shard.device.type != "cuda":
            return cpu_plan(self.max_len, settings)
        if settings.engine.slots or not self.static:
            return SlotPlan(settings.engine.slots or settings.engine.cpu_slots)
        cost = partial(self.slot_bytes, self.shard, self.step_tokens, self.max_draft)
        return memory_plan([(self.shard.device, cost, shard_workspace(self.shard, settings))], self.max_len, settings)

    @property
    def pools(self) -> list[KVPool]:
        """The static pools, short slots first."""
        return [p for p in (self.short_pool, self.pool) if p is not None]

    def slot_bytes(self, shard: Shard, step_tokens: int, max_draft: int, max_len: int | None = None) -> int:
        """Bytes a slot of this engine takes (of max_len positions, default the engine's): `engine_slot_cost`."""
        return engine_slot_cost(shard, max_len or self.max_len, step_tokens, max_draft, self.ring_slack)

    def _new_pool(self, slots: int, max_len: int | None = None) -> KVPool:
        scratch = self.step_tokens + self.max_draft  # a draft's extra steps may run past max_len
        return KVPool.for_shard(
            self.shard, slots=slots, max_len=max_len or self.max_len, scratch=scratch, ring_slack=self.ring_slack
        )

    def acquire(self, overflow: bool = True, need: int | None = None) -> Cache | None:
        """A cache for one sequence that will hold up to `need` positions (None: up to max_len): a short slot if
        it fits one, else a full-length slot; with `overflow`, a one-slot spare pool when those are taken; or a
        dynamic cache; None when the pools are full and `overflow` is off."""
        if self.pool is None:
            return self.shard.new_cache()
        pools = [p for p in self.pools if need is not None and need <= p.max_len] or [self.pool]
        cache = next((c for p in pools if (c := p.acquire()) is not None), None)
        if cache is None and not overflow:
            return None
        if cache is None:
            length = min(p.max_len for p in pools)
            try:  # list.pop and list.remove are atomic for threads sharing the engine
                spare = next(p for p in reversed(self._spare) if p.max_len >= length)
                self._spare.remove(spare)
            except (StopIteration, ValueError):
                spare = self._new_pool(1, length)
            cache = spare.acquire()
        assert cache is not None
        return cache

    def release(self, cache: Cache) -> None:
        """Return a sequence's cache; static slots (zeroed, `KVPool.release`, and their captured graphs) serve
        the next sequence. At most `slots` one-slot spare pools are kept; others are freed with their graphs."""
        if isinstance(cache, StaticKVCache):
            cache.pool.release(cache)
            if cache.pool in self.pools:
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
        self,
        caches: Sequence[Cache],
        xs: Sequence[torch.Tensor],
        starts: Sequence[int],
        logits_last: Logits = 0,
        ids: Sequence[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """Run one step of each sequence: x [m] ids (or [m, h]) at positions start..start+m-1 of its cache.

        Returns per sequence its hidden states [m, h], or the logits [n, vocab] of its last n rows
        (n = logits_last, one int or one per sequence). Static caches of one pool run as one batch. `ids`: each
        x's token ids [m], for a shard that takes them beside hidden states (`Shard.needs_ids`: Gemma 4's per-layer
        inputs)."""
        n = len(caches)
        check_ids(ids, xs, self.shard.needs_ids)
        wants = [logits_last] * n if isinstance(logits_last, int) else list(logits_last)
        for cache, x, start in zip(caches, xs, starts, strict=True):  # check every row before any runs
            self.check(cache, start, x.shape[0])
        out: list[torch.Tensor | None] = [None] * n
        steps: dict[int, list[int]] = {}  # round-sized steps per pool: graph batches
        longs: dict[int, list[int]] = {}  # longer ones (prompts): eager batches
        for i, (cache, x) in enumerate(zip(caches, xs, strict=True)):
            if isinstance(cache, StaticKVCache) and 0 < x.shape[0]:
                (steps if x.shape[0] <= self.step_tokens else longs).setdefault(id(cache.pool), []).append(i)
            else:
                out[i] = self.shard(x, starts[i], cache, wants[i], **({"ids": ids[i]} if ids is not None else {}))
        for idx in longs.values():
            for part in self._prefill_parts(idx, caches, xs, starts):
                got = self._batch(
                    [caches[i] for i in part],  # type: ignore[misc]
                    [xs[i] for i in part],
                    [starts[i] for i in part],
                    [wants[i] for i in part],
                    eager=True,
                    ids=[ids[i] for i in part] if ids is not None else None,
                )
                for i, o in zip(part, got, strict=True):
                    out[i] = o
        sizes = {pool: caches[idx[0]].pool.slots for pool, idx in steps.items()}  # type: ignore[union-attr]
        parts = [idx[at : at + sizes[k]] for k, idx in steps.items() for at in range(0, len(idx), sizes[k])]
        for n_part, part in enumerate(parts):
            got = self._batch(
                [caches[i] for i in part],  # type: ignore[misc]
                [xs[i] for i in part],
                [starts[i] for i in part],
                [wants[i] for i in part],
                ids=[ids[i] for i in part] if ids is not None else None,
            )
            for i, o in zip(part, got, strict=True):  # a graph's result lives until the next replay
                out[i] = o.clone() if self.graphs and n_part < len(parts) - 1 else o
        return out  # type: ignore[return-value]

    def _prefill_parts(
        self, idx: list[int], caches: Sequence[Cache], xs: Sequence[torch.Tensor], starts: Sequence[int]
    ) -> list[list[int]]:
        """`prefill_parts` of these rows (prompts of one pool) within this engine's prefill_tokens."""
        pool: KVPool = caches[idx[0]].pool  # type: ignore[union-attr]
        return prefill_parts(idx, [x.shape[0] for x in xs], starts, pool, self.prefill_tokens)

    def check(self, cache: Cache, start: int, m: int) -> None:
        """Raise ValueError unless `cache` holds exactly `start` positions and has room for m more."""
        if cache.length != start:
            raise ValueError(f"cache holds {cache.length} positions, round starts at {start}")
        if isinstance(cache, StaticKVCache) and start + m > cache.max_len:
            raise ValueError(f"sequence of {start + m} positions exceeds the static cache of {cache.max_len}")

    def _batch(
        self,
        caches: list[StaticKVCache],
        xs: list[torch.Tensor],
        starts: list[int],
        wants: list[int],
        eager: bool = False,
        ids: list[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """One batched forward of these rows: through a graph (rows padded to step_tokens, logits of 0, 1 or all
        rows), or with `eager` (prompts) padded to the longest and the logits of each row's last max(wants). `ids`:
        the rows' token ids, padded as they are (`forward_many`)."""
        dev, pool = self.shard.device, caches[0].pool
        sizes = [x.shape[0] for x in xs]
        graph = self.graphs and not eager
        t = self.step_tokens if graph and self.pad else max(sizes)
        p = (0 if max(wants) == 0 else (1 if max(wants) == 1 else t)) if graph else max(wants)
        length = self.attended(pool, max(starts) + t)  # padding too: a window past the attended columns sees none
        x = padded(xs, t)
        meta = [
            [
                c.slot,
                s + m - 1,
                *range(s, s + t),
                *([m - 1] if p == 1 else range(t - p, t) if graph else pick_last(m, p)),
            ]
            for c, s, m in zip(caches, starts, sizes, strict=True)
        ]
        meta_t = torch.tensor(meta, dtype=torch.long).to(dev, non_blocking=True)
        rows, last, pos, pick = meta_t[:, 0], meta_t[:, 1], meta_t[:, 2 : 2 + t], (meta_t[:, 2 + t :] if p else None)
        extra = {"ids": padded(ids, t).to(dev, non_blocking=True)} if ids is not None else {}
        if graph:
            out = self._graph(pool, len(caches), t, p, length=length)(rows, x, pos, pick, **extra)
        else:  # prompts never through torch.compile: their lengths vary
            run = self.shard.run_batch if eager else self.run_batch
            out = run(x, pos, BatchView(pool, rows, pos, length, last=last), pick, **extra)
        for cache, start, m in zip(caches, starts, sizes, strict=True):  # padding wrote up to start + t
            cache.advance(start + m, start + t)
        if p == 0:
            return [out[b, :m] for b, m in enumerate(sizes)]
        if p == 1:
            return [out[b] for b in range(len(sizes))]
        if not graph:  # each row's picks are its last p rows
            return [out[b, p - w : p] for b, w in enumerate(wants)]
        return [out[b, m - w : m] for b, (m, w) in enumerate(zip(sizes, wants, strict=True))]

    def draft_many(
        self, caches: Sequence[Cache], feeds: Sequence[list[int]], starts: Sequence[int], ks: Sequence[int]
    ) -> torch.Tensor | None:
        """Greedy drafts [n, >= max(ks)] (device; row b's first ks[b] are its own) of sequences of one pool,
        each from its feed of new token ids at start..: one graph replay for all steps, one host-to-device copy
        for all inputs. Caches then hold feed + the first k-1 drafts of their own k.
        None (nothing run) where this does not apply: dynamic caches, several pools, long feeds or drafts.
        Without graphs (static caches on CPU, say) the same steps run eagerly."""
        # every whole draft is max_draft long (rows keep their own k): adaptive K changes k from round to round, and a
        # graph per (batch, feed, k) would mean a capture in most of a job's first rounds and a memory pool per k
        k = self.max_draft
        pool = getattr(caches[0], "pool", None)
        sizes = [len(f) for f in feeds]
        if (
            not self.static
            or max(ks) > self.max_draft
            or min(ks) < 1
            or pool is None
            or len(caches) > pool.slots
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
            out = greedy_steps(self.run_batch, pool, rows, x, pos, pick, k, length, self.shard.attends_in_place)  # type: ignore[arg-type]
        for cache, start, m, kb in zip(caches, starts, sizes, ks, strict=True):  # every row drafted k steps
            cache.advance(start + m + kb - 1, max(start + t, start + m + k - 1))  # type: ignore[union-attr]
        return out

    def capture(self, shapes: Sequence[tuple[int, int, int]]) -> int:
        """Capture, for every batch bucket of each pool and every attended length up to capture_len, the
        graphs of these (tokens, picked rows, draft steps) shapes now rather than at their first use (a
        capture takes tens of milliseconds, and the first jobs of a worker would pay for dozens); the number
        of graphs captured. Nothing without CUDA graphs."""
        if not self.graphs or self.pool is None:
            return 0
        before = len(self._graphs)
        with torch.inference_mode():  # as rounds run (else autograd would keep every intermediate alive)
            for pool in sorted(self.pools, key=lambda q: -q.slots):  # largest batches first: the rest reuse memory
                lengths = self.capture_lengths(pool)
                for size in reversed(buckets(pool.slots)):
                    for t, p, steps in shapes:
                        for n in reversed(lengths):
                            self._graph(pool, size, t, p, steps, n, log_it=False)
        self.log_memory()
        return len(self._graphs) - before

    def memory(self) -> dict[str, float]:
        """GB this engine holds on its device: weights, KV caches (main and spare pools), CUDA graphs."""
        weights = self.shard.weight_bytes()
        pools = [*self.pools, *self._spare]
        caches = sum(t.numel() * t.element_size() for p in pools for t in (*p.keys.values(), *p.values.values()))
        return {"weights": weights / GB, "caches": caches / GB, "graphs": self.graph_bytes / GB}

    @staticmethod
    def memory_note(engines: Sequence[Engine]) -> str:
        """What these engines hold together, as worker logs say it."""
        parts = [e.memory() for e in engines]
        total = {k: sum(p[k] for p in parts) for k in ("weights", "caches", "graphs")}
        return "weights {weights:.2f} GB, caches {caches:.2f} GB, graphs {graphs:.2f} GB".format(**total)

    def log_memory(self) -> None:
        m = self.memory()
        log.info(
            "%s memory: weights %.2f GB, caches %.2f GB, graphs %.2f GB (%d graphs, %s slots)",
            self.label,
            m["weights"],
            m["caches"],
            m["graphs"],
            len(self._graphs),
            " + ".join(f"{p.slots} of {p.max_len}" for p in reversed(self.pools)) or self.slots,
        )

    def capture_lengths(self, pool: KVPool) -> list[int]:
        """The attended lengths graphs are captured for when the engine starts (one where attention is in place)."""
        if self.shard.attends_in_place:  # rows below LONG_REACH; longer ones' graphs (keys in chunks) at first use
            return [min(pool.index.shape[0], pool_attention.LONG_REACH)]
        return [n for n in attended_lengths(pool) if n <= self.capture_len] or attended_lengths(pool)[:1]

    def attended(self, pool: KVPool, need: int) -> int:
        """The attended length of a batch whose rows use positions below `need`: with graphs the smallest of
        `attended_lengths` that holds them (a few lengths, so a few graphs per shape), else `need` rounded up
        to 64 (eager batches gather and attend over no more than they use)."""
        full = pool.index.shape[0]
        if self.shard.attends_in_place:  # each row's own length; keys in chunks past LONG_REACH: two graphs a shape
            return full if need > pool_attention.LONG_REACH else min(full, pool_attention.LONG_REACH)
        if not self.graphs:
            return min(-(-need // 64) * 64, full)
        return next((n for n in attended_lengths(pool) if n >= need), full)

    def _graph(
        self, pool: KVPool, b: int, t: int, p: int, steps: int = 0, length: int | None = None, log_it: bool = True
    ) -> BatchGraph:
        size = next(s for s in buckets(pool.slots) if s >= b)
        key = (id(pool), size, t, p, steps, length)
        graph = self._graphs.get(key)
        if graph is None:
            dev = self.shard.device
            before = torch.cuda.memory_reserved(dev) if dev.type == "cuda" else 0
            graph = BatchGraph(self.shard, self.run_batch, pool, size, t, p, steps, length, self.graph_memory)
            self._graphs[key] = graph
            self.graph_bytes += (torch.cuda.memory_reserved(dev) if dev.type == "cuda" else 0) - before
            if log_it:  # a capture at first use (a longer attended length, a spare pool)
                log.info(
                    "%s: captured a graph at first use (batch %d, %d tokens, %d picked, %d steps, %s positions)",
                    self.label,
                    size,
                    t,
                    p,
                    steps,
                    length,
                )
                self.log_memory()
        return graph
