"""How big a worker's caches are: static or growing, positions per slot, slots from the device's memory, and
the lengths a batch attends over (so graphs come in a few sizes)."""

from __future__ import annotations

import torch

from schemas.settings import Settings
from workers.engine.kvcache import KVPool
from workers.engine.shard import Shard


def cache_modes(shard: Shard, static: bool | None, graphs: bool | None) -> tuple[bool, bool]:
    """(static caches, CUDA graphs) as asked, by default both on a CUDA device and neither elsewhere."""
    cuda = shard.device.type == "cuda"
    graphs = cuda if graphs is None else graphs
    if graphs and not cuda:
        raise ValueError("CUDA graphs need a CUDA device")
    return graphs or (cuda if static is None else static), graphs


def cache_len(shard: Shard, max_len: int | None, settings: Settings) -> int:
    """Positions a static cache holds: max_len (default settings.static_cache_len), within the model's limit."""
    limit = getattr(shard.config, "max_position_embeddings", None) or settings.static_cache_len
    return min(max_len or settings.static_cache_len, limit)


def fit_slots(device: torch.device, slot_bytes: int, settings: Settings) -> int:
    """Slots of `slot_bytes` each that fit what the worker may still fill of a CUDA device (settings.gpu_memory,
    less what is allocated and what other processes hold, less graph_reserve); 1 to max_slots."""
    total = torch.cuda.get_device_properties(device).total_memory
    allowed = settings.gpu_memory * total if settings.gpu_memory <= 1 else settings.gpu_memory * 2**30
    free, _ = torch.cuda.mem_get_info(device)
    left = min(allowed - torch.cuda.memory_allocated(device), free) * (1 - settings.graph_reserve)
    return max(1, min(settings.max_slots, int(left // max(slot_bytes, 1))))


def attended_lengths(pool: KVPool) -> list[int]:
    """Lengths a batch attends over: 512, 1024, ... below the pool's slot length, then all of it."""
    full, out = pool.index.shape[0], []
    n = 512
    while n < full:
        out.append(n)
        n *= 2
    return [*out, full]
