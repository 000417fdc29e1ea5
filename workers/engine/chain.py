"""One worker's layers over several of its machine's devices: `--devices cuda:0,cuda:1` (EngineSettings.devices).

A worker whose layers outgrow one GPU of its machine (a Kaggle notebook's two T4s) spreads them over its GPUs in
consecutive ranges, each device a `Shard` of its own run by an `Engine` of its own (its static caches and CUDA graphs
on that device), chained in the worker's process. Nothing goes through Redis or the host between them: a batch's rows
move to the next device as one device-to-device copy.

- `device_ranges` cuts the worker's layers so that each device holds about the same bytes of weights: the embedding
  with the first range, the norm and LM head with the last, and a head's drafter where it sits (`--draft-device`,
  by default the first device), from the loader's own sizes (`plan.model_shape`). `shardflow plan` prints
  `--devices` for a worker spanning its machine's GPUs (workers/engine/plan_stages.py balances their compute, which
  for devices of one size is their weights' bytes).
- `ChainShard` is what the worker sees as its shard: the layer range, config and dtype of the whole, the embedding of
  its first part and the norm and LM head of its last. Its `device` is the last part's, where outputs land (a head's
  hidden rows, a tail's logits, which verification compares on that device); inputs given on any device move to the
  first part's.
- `EngineChain` runs a step of many sequences part after part. A sequence holds a `ChainCache`, one cache of each
  part (a slot of each part's pool), acquired, cropped and released together. The parts' slots are planned jointly:
  as many as the device that holds the fewest (`sizing.memory_plan`, one entry a device, parts on one device summed).

On a CPU, `--devices cpu,cpu` runs the same code with both parts on the one device (the tests' two-device split).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from transformers import PretrainedConfig

from schemas.settings import Settings
from workers.engine.plan import model_shape, shard_weights
from workers.engine.runner import Engine, Logits
from workers.engine.shard import Cache, Shard
from workers.engine.sizing import (
    SlotPlan,
    cache_len,
    cache_modes,
    cpu_plan,
    engine_slot_cost,
    memory_plan,
    ring_slack,
    shard_workspace,
)

log = logging.getLogger("shardflow.engine")


def device_ranges(
    config: PretrainedConfig,
    layers: tuple[int, int],
    devices: int,
    *,
    embed: bool,
    head: bool,
    first_extra: int = 0,
    dtype: torch.dtype = torch.float32,
    quant: str = "none",
) -> list[tuple[int, int]]:
    """Layers [a, b) cut into `devices` consecutive ranges of at least one layer each that hold about the same bytes:
    the smallest ceiling on any device's weights that a greedy cover meets, found over the candidate ceilings (each
    a range's bytes). `first_extra`: bytes beside the first range (a head's drafter on that device)."""
    a, b = layers
    if not 1 <= devices <= b - a:
        raise ValueError(f"{devices} devices for {b - a} layers: each device needs at least one layer")
    shape = model_shape(config, dtype, quant)

    def weight(lo: int, hi: int) -> int:
        extra = first_extra if lo == a else 0
        return extra + shard_weights(shape, (lo, hi), embed=embed and lo == a, head=head and hi == b)

    def cover(ceiling: int) -> list[tuple[int, int]] | None:
        out, lo = [], a
        for d in range(devices):
            left = devices - d - 1  # each later device keeps at least a layer
            hi = lo + 1
            while hi < b - left and weight(lo, hi + 1) <= ceiling:
                hi += 1
            if weight(lo, hi) > ceiling:
                return None
            out.append((lo, hi))
            lo = hi
        return out if lo == b else None

    ceilings = sorted({weight(lo, hi) for lo in range(a, b) for hi in range(lo + 1, b + 1)})
    return next(got for c in ceilings if (got := cover(c)) is not None)


def whole_bytes(config: PretrainedConfig, dtype: torch.dtype = torch.float32, quant: str = "none") -> int:
    """Bytes of a whole model's weights (a head's drafter beside its first range: `device_ranges`' first_extra)."""
    shape = model_shape(config, dtype, quant)
    return shard_weights(shape, (0, shape.layers), embed=True, head=True)


class ChainShard:
    """A worker's layers as consecutive `Shard`s on its devices, seen by the worker as one shard (the module
    docstring): what heads and tails read of their shard (config, layer range, dtype, device, LM head, whether its
    layers take token ids); the parts themselves are run by `EngineChain`'s engines."""

    def __init__(self, parts: list[Shard]) -> None:
        if len(parts) < 2:
            raise ValueError("a chain spans at least two parts")
        for left, right in itertools.pairwise(parts):
            if left.layer_range[1] != right.layer_range[0]:
                raise ValueError(f"parts {left.layer_range} and {right.layer_range} do not meet")
        self.parts = parts
        self.config = parts[0].config
        self.layer_range = (parts[0].layer_range[0], parts[-1].layer_range[1])
        self.lm_head = parts[-1].lm_head

    @property
    def device(self) -> torch.device:
        return self.parts[-1].device

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype

    @property
    def needs_ids(self) -> bool:
        return any(p.needs_ids for p in self.parts)

    @property
    def attends_in_place(self) -> bool:
        return all(p.attends_in_place for p in self.parts)


@dataclass
class ChainCache:
    """One sequence's caches, one a part, moved together."""

    parts: list[Cache]

    @property
    def length(self) -> int:
        return self.parts[0].length

    def crop(self, length: int) -> None:
        for c in self.parts:
            c.crop(length)


def chain_plan(shard: ChainShard, settings: Settings, step_tokens: int) -> SlotPlan:
    """The slots every part holds, as `Engine._plan` sizes one engine's: a CPU's plan on a CPU; engine.slots (or
    cpu_slots for growing caches) where set; else as many as the device that holds the fewest (the parts on one
    device costed together, its largest workspace kept free)."""
    max_len = min(cache_len(p, settings) for p in shard.parts)
    if shard.device.type != "cuda":
        return cpu_plan(max_len, settings)
    if settings.engine.slots or not cache_modes(shard.parts[0], settings.engine)[0]:
        return SlotPlan(settings.engine.slots or settings.engine.cpu_slots)
    by_device: dict[torch.device, list[Shard]] = {}
    for p in shard.parts:
        by_device.setdefault(p.device, []).append(p)
    slack = ring_slack(settings, step_tokens, 0)

    def cost(parts: list[Shard], n: int) -> int:
        return sum(engine_slot_cost(p, n, step_tokens, 0, slack) for p in parts)

    entries = [
        (dev, partial(cost, parts), max(shard_workspace(p, settings) for p in parts))
        for dev, parts in by_device.items()
    ]
    return memory_plan(entries, max_len, settings)


class EngineChain:
    """Runs a `ChainShard` over sequences' `ChainCache`s: each part by its own `Engine` (the module docstring)."""

    def __init__(
        self,
        shard: ChainShard,
        settings: Settings | None = None,
        *,
        slots: SlotPlan | None = None,
        label: str = "shard",
    ) -> None:
        settings = settings or Settings()
        step_tokens = settings.engine.graph_k + 1
        plan = slots or chain_plan(shard, settings, step_tokens)
        self.shard, self.label = shard, label
        self.parts = [Engine(p, settings, slots=plan, label=f"{label} {p.device}") for p in shard.parts]
        first = self.parts[0]
        self.static, self.graphs, self.step_tokens = first.static, first.graphs, first.step_tokens
        self.max_len = min(e.max_len for e in self.parts)
        self.slots = min(e.slots for e in self.parts)
        self.max_draft = 0  # a chain never drafts: a head's drafter is an engine of its own

    def acquire(self, overflow: bool = True, need: int | None = None) -> ChainCache | None:
        """A cache of each part (`Engine.acquire`), or None, every part's given back, where one part has none."""
        got: list[Cache] = []
        for engine in self.parts:
            cache = engine.acquire(overflow=overflow, need=need)
            if cache is None:
                for e, c in zip(self.parts, got, strict=False):
                    e.release(c)
                return None
            got.append(cache)
        return ChainCache(got)

    def release(self, cache: ChainCache) -> None:
        for engine, c in zip(self.parts, cache.parts, strict=True):
            engine.release(c)

    def forward(self, cache: ChainCache, x: torch.Tensor, start: int, logits_last: int = 0) -> torch.Tensor:
        return self.forward_many([cache], [x], [start], logits_last)[0]

    def forward_many(
        self,
        caches: Sequence[ChainCache],
        xs: Sequence[torch.Tensor],
        starts: Sequence[int],
        logits_last: Logits = 0,
        ids: Sequence[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """`Engine.forward_many` part after part: each part's rows moved to its device, logits from the last only.
        A part's result that lives in its graph's buffer is read by the next part before that graph replays again."""
        rows = list(xs)
        for i, engine in enumerate(self.parts):
            dev, last = engine.shard.device, i == len(self.parts) - 1
            rows = [x.to(dev, non_blocking=True) for x in rows]
            wants_ids = ids is not None and engine.shard.needs_ids
            part_ids = [t.to(dev, non_blocking=True) for t in ids] if wants_ids else None  # type: ignore[union-attr]
            part_caches = [c.parts[i] for c in caches]
            rows = engine.forward_many(part_caches, rows, starts, logits_last if last else 0, ids=part_ids)
        return rows

    def capture(self, shapes: Sequence[tuple[int, int, int]]) -> int:
        """Each part's graphs of these shapes (`Engine.capture`); a part before the last returns hidden rows only."""
        n = 0
        for i, engine in enumerate(self.parts):
            last = i == len(self.parts) - 1
            n += engine.capture(shapes if last else list(dict.fromkeys((t, 0, s) for t, _, s in shapes)))
        return n

    def memory(self) -> dict[str, float]:
        parts = [e.memory() for e in self.parts]
        return {k: sum(p[k] for p in parts) for k in ("weights", "caches", "graphs")}

    def log_memory(self) -> None:
        for engine in self.parts:
            engine.log_memory()


WorkerShard = Shard | ChainShard  # a worker's layers: on one device, or over several
WorkerEngine = Engine | EngineChain  # what runs them


def load_chain(
    load: Callable[..., Shard],
    config: PretrainedConfig,
    layers: tuple[int, int],
    devices: Sequence[str],
    *,
    embed: bool,
    head: bool,
    first_extra: int = 0,
    dtype: torch.dtype | None = None,
    quant: str = "none",
) -> ChainShard:
    """The worker's layers as a `ChainShard` over `devices`: `device_ranges`' cuts, each range loaded by `load(range,
    embed=, head=, device=)` (the registry's loader with the worker's other settings bound)."""
    ranges = device_ranges(
        config, layers, len(devices), embed=embed, head=head, first_extra=first_extra,
        dtype=dtype or torch.float32, quant=quant,
    )  # fmt: skip
    log.info("layers %d:%d over %s: %s", *layers, ",".join(devices), " ".join(f"{a}:{b}" for a, b in ranges))
    parts = [
        load(r, embed=embed and i == 0, head=head and i == len(ranges) - 1, device=dev)
        for i, (r, dev) in enumerate(zip(ranges, devices, strict=True))
    ]
    return ChainShard(parts)


def make_engine(
    shard: WorkerShard, settings: Settings, *, slots: SlotPlan | None = None, label: str = "shard"
) -> WorkerEngine:
    """The engine a worker runs its shard with: an `EngineChain` for a chain, else an `Engine`."""
    if isinstance(shard, ChainShard):
        return EngineChain(shard, settings, slots=slots, label=label)
    return Engine(shard, settings, slots=slots, label=label)
