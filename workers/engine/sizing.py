"""How big a worker's caches are: static or growing, positions per slot, slots from the device's memory (a
slot costs its keys/values plus what one more row of a batched forward takes), and the lengths a batch
attends over (so graphs come in a few sizes)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch

from schemas.settings import EngineSettings, Settings
from workers.engine.kvcache import BatchView, KVPool
from workers.engine.per_layer import takes_layer_inputs, widest_kv, widest_mlp
from workers.engine.quant_experts import dequantized_bytes
from workers.engine.shard import FUSED_MAX_SCORE_BYTES, Shard, blank_input

ALLOCATOR_SLACK = 512 << 20  # what fragmentation and small buffers take beside counted memory (expandable segments)


def cache_modes(shard: Shard, engine: EngineSettings) -> tuple[bool, bool]:
    """(static caches, CUDA graphs) as engine.static / engine.graphs ask; by default static caches everywhere (the
    rounds of the sequences in flight run as one batched forward: on a CPU too, where 8 sequences' rounds cost
    about 3x one's, where growing caches cost 8x) and CUDA graphs on a CUDA device, except for a shard with a
    `graphs_reason` (Gemma 4's mixture-of-experts variant in float32: only where engine.graphs asks)."""
    static, graphs, cuda = engine.static, engine.graphs, shard.device.type == "cuda"
    if shard.graphs_reason is not None and graphs is None:  # Gemma 4's MoE in float32: graphs only where asked
        graphs = False
    graphs = cuda if graphs is None else graphs
    if graphs and not cuda:
        raise ValueError("CUDA graphs need a CUDA device")
    return graphs or (True if static is None else static), graphs


def linger_s(shard: Shard, settings: Settings) -> float:
    """Seconds a batch waits for stragglers: settings.engine.batch_linger_ms, by default 5 ms on a CPU and 0 on CUDA."""
    ms = settings.engine.batch_linger_ms
    return (ms if ms is not None else 0.0 if shard.device.type == "cuda" else 5.0) / 1000


def cache_len(shard: Shard, settings: Settings) -> int:
    """Positions a static cache holds: settings.engine.max_len, within the model's limit."""
    limit = getattr(shard.config, "max_position_embeddings", None) or settings.engine.max_len
    return min(settings.engine.max_len, limit)


def ring_slack(settings: Settings, step_tokens: int, max_draft: int) -> int | None:
    """What an engine's windowed layers keep beyond their window (workers/engine/rings.py): engine.window_slack, and
    never less than its own graph steps and whole drafts; None: every position."""
    slack = settings.engine.window_slack
    return None if slack is None else max(slack, step_tokens + max_draft)


def slot_cost(shard: Shard, max_len: int, step_tokens: int, scratch: int, ring_slack: int | None = None) -> int:
    """Bytes one more sequence costs a static engine on a CUDA device: its slot of keys/values and what one more
    row adds to a batched forward of `step_tokens` attending over the whole slot (the graph memory pool holds
    the largest such batch) and to the graphs' output buffer. A tail's row counts step_tokens x its logits there,
    more than its output buffers hold (step_tokens + 1 rows of logits): counted as held, a 7B-shaped 4-bit tail
    ran out of memory capturing its graphs in 15 GiB (docs/runs/journal.md, run 41): `row_bytes` of a 4-bit shard
    undercounts its rows (the peaks of 4 and 8 rows are both set by a dequantized weight; run 43). Measured at up
    to 32 rows instead, over the whole slot, they cost a 14B-shaped 4-bit head a quarter of its slots (run 44),
    so the margin stays until rows are measured at the lengths graphs are captured for."""
    kv = KVPool.slot_bytes(shard, max_len, scratch, ring_slack)
    if shard.device.type != "cuda":
        return kv
    p = step_tokens if shard.lm_head is not None else 0
    out = step_tokens * (p * shard.config.vocab_size if p else shard.config.hidden_size)
    # linear-attention layers' rows counted twice: a hybrid-4b head's graphs of 64 rows reserved 1.93 GiB where its
    # rows measured 15.4 MiB each (docs/runs/journal.md, run 97), and sized at one, its head ran out capturing
    rows = row_bytes(shard, step_tokens, p, max_len + scratch) * (2 if shard.recurrent else 1)
    return kv + rows + out * shard.dtype.itemsize


def engine_slot_cost(
    shard: Shard, max_len: int, step_tokens: int, max_draft: int, ring_slack: int | None = None
) -> int:
    """`slot_cost` of an engine feeding step_tokens a round with drafts of up to max_draft steps, plus, for a
    drafter on CUDA whose attention reads a copy, the copy of its rows' keys and values its whole drafts hold
    (`DraftBuffer`): left out of the head's joint plan, a Qwen3-0.6B-shaped drafter's copies ran a Qwen3-8B head
    out of memory capturing its graphs (docs/runs/journal.md, run 71)."""
    scratch = step_tokens + max_draft
    buffered = max_draft and shard.device.type == "cuda" and not shard.attends_in_place
    copy = KVPool.slot_bytes(shard, max_len, scratch, ring_slack) if buffered else 0
    return slot_cost(shard, max_len, step_tokens, scratch, ring_slack) + copy


@torch.inference_mode()
def row_bytes(shard: Shard, t: int, p: int, length: int) -> int:
    """Device memory a batched forward (t tokens a row, logits of p rows, attention over `length` positions)
    takes per row, measured: the peak of 8 rows less that of 4, over 4. Run without the fused layers, whose
    attention is used only while the whole batch's scores stay under a fixed cap."""
    dev = shard.device
    pool = KVPool.for_shard(shard, slots=1, max_len=length, scratch=t)
    fused, shard.fused = shard.fused, None
    peaks = []
    try:
        for b in (4, 8):
            pos = pool.index[-t:].expand(b, t).clone()
            rows = torch.zeros(b, dtype=torch.long, device=dev)
            x = blank_input(shard, b, t)
            pick = torch.arange(t - p, t, device=dev).expand(b, p) if p else None
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
            ids = torch.zeros(b, t, dtype=torch.long, device=dev) if shard.needs_ids else None  # a Gemma 4 tail's
            y = shard.run_batch(x, pos, BatchView(pool, rows, pos, length), pick, ids=ids)
            torch.cuda.synchronize(dev)
            peaks.append(torch.cuda.max_memory_allocated(dev) - base)
            del y
    finally:
        shard.fused = fused
        del pool
    return max(peaks[1] - peaks[0], 0) // 4


@dataclass(frozen=True)
class SlotPlan:
    """A static engine's slots: `slots` of the full cache length, and `short` slots of `short_len` positions
    for sequences whose prompt and new tokens fit them (none when short is 0)."""

    slots: int
    short: int = 0
    short_len: int = 0

    @property
    def total(self) -> int:
        return self.slots + self.short


def workspace_bytes(config: object, dtype_bytes: int, settings: Settings) -> int:
    """What a worker keeps free beside its weights and slots for what is not counted per slot: a batched prefill
    of prefill_tokens tokens (one layer's activations, and the fused attention's score budget) and allocator
    slack. On a small card this is more than graph_reserve's share."""
    heads = config.num_attention_heads  # type: ignore[attr-defined]
    mlp = config.intermediate_size  # type: ignore[attr-defined]
    if takes_layer_inputs(config):  # type: ignore[arg-type]  # Gemma 4: dims per layer type, its widest layer's
        (kv, head_dim, _), mlp = widest_kv(config), widest_mlp(config)  # type: ignore[arg-type]
    else:
        kv = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads  # type: ignore[attr-defined]
    width = (heads + 2 * kv) * head_dim + 2 * mlp + 4 * config.hidden_size  # type: ignore[attr-defined]
    return settings.engine.prefill_tokens * width * dtype_bytes + FUSED_MAX_SCORE_BYTES + ALLOCATOR_SLACK


def reserve_bytes(left: float, workspace: int, settings: Settings) -> float:
    """Of `left` bytes after the weights, what slots may not take: graph_reserve's share, at least `workspace`."""
    return max(left * settings.engine.graph_reserve, workspace)


def process_budget(device: torch.device, settings: Settings) -> int | None:
    """A worker process's memory budget in bytes: settings.engine.gpu_memory as a share of its CUDA device or GiB; on a
    CPU only a budget given in GiB (None: no budget)."""
    g = settings.engine.gpu_memory
    if device.type == "cuda":
        return int(g * torch.cuda.get_device_properties(device).total_memory if g <= 1 else g * 2**30)
    return int(g * 2**30) if g > 1 else None


def allocator_budget(device: torch.device, settings: Settings) -> int | None:
    """What the worker's tensors may take: its process budget less, on CUDA, what the process holds outside the
    allocator (settings.engine.cuda_context_gib)."""
    whole = process_budget(device, settings)
    if whole is None or device.type != "cuda":
        return whole
    return max(whole - int(settings.engine.cuda_context_gib * 2**30), 0)


def budget(device: torch.device, settings: Settings, workspace: int = 0) -> float:
    """Bytes the worker may still fill of a CUDA device with slots: its `allocator_budget` less what its
    allocator holds and what other processes hold, less the reserve for what is not counted per slot (prefills,
    workspaces, fragmentation: `reserve_bytes`). Blocks the allocator caches but no tensor holds are given back
    first: loading a quantized shard frees its full-precision weights into that cache, and counted as held they
    left a Qwen3-30B-A3B-shaped 4-bit tail in 15 GiB one slot where the plan gives it five (docs/runs/journal.md,
    run 79)."""
    allowed = allocator_budget(device, settings) or 0
    if torch.cuda.is_initialized():
        with torch.cuda.device(device):
            torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    left = min(allowed - torch.cuda.memory_reserved(device), free)
    return max(left - reserve_bytes(left, workspace, settings), 0.0)


SHORT_STEP = 256  # positions a short slot shrinks by at a time (`short_lengths`)


def short_lengths(max_len: int, settings: Settings) -> list[int]:
    """Lengths a short slot may take, longest first: `short_len_of`, then shorter by SHORT_STEP down to
    engine.short_cache_min; [0] where there are no short slots."""
    longest = short_len_of(max_len, settings)
    floor = min(settings.engine.short_cache_min, longest)
    return [*range(longest, floor, -SHORT_STEP), floor] if longest else [0]


def full_slots(left: float, cost: int, short_len: int, settings: Settings) -> int:
    """Full-length slots (`cost` bytes each) of `left` bytes: long_slots_share of it where there are short ones
    (a short length), else all of it; at least one, at most max_slots."""
    share = settings.engine.long_slots_share if short_len else 1.0
    return max(1, min(settings.engine.max_slots, int(left * share // max(cost, 1))))


def short_slots(left: float, cost: int, short_cost: int, full: int, settings: Settings) -> int:
    """Short slots (`short_cost` bytes each) in what `full` full-length ones leave of `left`; max_slots in all."""
    return max(0, min(settings.engine.max_slots - full, int((left - full * cost) // max(short_cost, 1))))


def split_slots(budgets: list[tuple[float, Callable[[int], int]]], max_len: int, settings: Settings) -> SlotPlan:
    """Slots that every one of `budgets` (bytes left, and what one slot of n positions costs there) holds:
    `full_slots` of max_len positions, then `short_slots` of the longest of `short_lengths` that holds max_slots
    in all (a batch of short jobs then runs at once, not in two waves), or of the longest where none does (a
    small card keeps room for longer jobs). Workers (`memory_plan`) and `shardflow plan`
    (workers/engine/plan.py) both size slots so."""
    costs = [(left, cache(cost)) for left, cost in budgets]  # a worker's costs are measured
    plans = []
    for n in short_lengths(max_len, settings):
        full = min(full_slots(left, cost(max_len), n, settings) for left, cost in costs)
        short = min(short_slots(left, cost(max_len), cost(n), full, settings) for left, cost in costs) if n else 0
        plans.append(SlotPlan(full, short, n))
        if plans[-1].total >= settings.engine.max_slots:
            return plans[-1]
    return plans[0]


def cpu_plan(max_len: int, settings: Settings) -> SlotPlan:
    """A CPU worker's slots: settings.engine.slots full-length ones if given, else settings.engine.cpu_slots, of which
    long_slots_share full-length (at least one) and the rest short."""
    if settings.engine.slots:
        return SlotPlan(settings.engine.slots)
    short = short_len_of(max_len, settings)
    if not short:
        return SlotPlan(settings.engine.cpu_slots)
    full = max(1, round(settings.engine.cpu_slots * settings.engine.long_slots_share))
    return SlotPlan(full, max(settings.engine.cpu_slots - full, 0), short)


def memory_plan(
    parts: list[tuple[torch.device, Callable[[int], int], int]], max_len: int, settings: Settings
) -> SlotPlan:
    """Slots of max_len positions and short ones (`split_slots`) that each of `parts` holds: a device, what one
    slot of n positions costs on it, and the least its `budget` keeps free there (`workspace_bytes`)."""
    budgets = [(budget(device, settings, workspace), cost) for device, cost, workspace in parts]
    return split_slots(budgets, max_len, settings)


def shard_workspace(shard: Shard, settings: Settings) -> int:
    """`workspace_bytes`, plus the experts one layer's forward dequantizes at once where they are stored quantized
    (workers/engine/quant_experts.py; the plan's `ModelShape.experts_scratch`)."""
    scratch = max((dequantized_bytes(layer) for layer in shard.layers), default=0)
    return workspace_bytes(shard.config, shard.dtype.itemsize, settings) + scratch


def short_len_of(max_len: int, settings: Settings) -> int:
    """Positions of a short slot: settings.engine.short_cache_len when shorter than the full length, else 0 (none)."""
    return settings.engine.short_cache_len if 0 < settings.engine.short_cache_len < max_len else 0


def attended_lengths(pool: KVPool) -> list[int]:
    """Lengths a batch attends over: 512, 1024, ... below the pool's slot length, then all of it."""
    full, out = pool.index.shape[0], []
    n = 512
    while n < full:
        out.append(n)
        n *= 2
    return [*out, full]
