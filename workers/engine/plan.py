"""The memory plan: what a worker's weights and caches take, from a model's config and tensor shapes alone (the
model is built on the meta device; no weight is read), how to split a model's layers between a head and a
tail on GPUs of given sizes, and the check a worker makes before it loads anything.

    plan = plan_split(config, gpus=[15 * GiB, 15 * GiB], dtype=torch.float16, quant="4bit", draft=draft_config)
    print(render(plan))          # `shardflow plan` prints this

A worker's budget (`--gpu-memory`) bounds everything it allocates: weights, then KV caches sized to fill
what is left (less a reserve for workspaces and prefills: graph_reserve's share, at least
`sizing.workspace_bytes`), each slot counted with its rows of a batched
forward. The split maximises the jobs the pair can hold in flight (the fewer of the head's and the tail's
slots): layers go where memory is left, as the auto-partitioner of ShardFlow v2.1 (the public
split-inference system this project is measured against) gives layers in proportion to memory. Row costs
are estimated here (workers measure theirs at start), so slot counts are estimates; weights are exact for
the layouts `load_shard` loads. `Costs` counts a device's share (layers, embedding, LM head, drafter) as
`worker_needs` does; the plan for a head, middle stages and a tail uses it too (workers/engine/plan_stages.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from schemas.errors import ModelLoadError
from schemas.settings import Settings
from workers.engine.layouts import kv_dims, slot_length
from workers.engine.linear_pool import ring_row_bytes
from workers.engine.per_layer import plan_cuts, shape_fields, takes_layer_inputs, widest_kv
from workers.engine.quant import quantized_bytes
from workers.engine.quant_experts import EXPERT_COPIES, expert_weights
from workers.engine.recurrent import state_bytes
from workers.engine.refusals import refuse_half, refuse_layers, refuse_layout, refuse_windows
from workers.engine.rings import ring_length
from workers.engine.sizing import allocator_budget, reserve_bytes, split_slots, workspace_bytes
from workers.engine.windows import layer_windows

GiB = 1 << 30


@dataclass(frozen=True)
class ModelShape:
    """Bytes of a model's parts at one dtype and quantization (a layer: all of its tensors)."""

    layers: int
    layer: tuple[int, ...]  # each layer's bytes (a first dense layer of a mixture of experts weighs less)
    embed: int
    norm: int
    lm_head: int
    kv_per_position: int  # keys + values of one attention layer, one position
    hidden: int
    intermediate: int
    heads: int
    vocab: int
    head_dim: int = 0
    tied: bool = False  # the LM head is the embedding (held once by a shard that has both)
    kv_layer: tuple[int, ...] = ()  # each layer's keys + values a position (0: a linear-attention layer)
    state_layer: tuple[int, ...] = ()  # each layer's fixed state a sequence (a linear-attention layer's)
    state_row: tuple[int, ...] = ()  # what a linear layer's static pool keeps of each recent position (linear_pool.py)
    window_layer: tuple[int | None, ...] = ()  # each layer's sliding window (None: it sees every position)
    # one layer's experts dequantized at once by a forward (quantized experts: workers/engine/quant_experts.py), the
    # largest layer's: a worker's workspace holds it beside a prefill's
    experts_scratch: int = 0
    per_layer: tuple[int, ...] = ()  # each layer's per-layer-input weights (Gemma 4: workers/engine/per_layer.py)
    per_layer_norm: int = 0  # their norm, held by every shard that has them


def model_shape(config: PretrainedConfig, dtype: torch.dtype, quant: str = "none") -> ModelShape:
    """Sizes from the config: the model is built on the meta device, so shapes are the loader's own."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    base = model.get_decoder()
    refuse_layout(model)
    refuse_windows(config)  # what a worker refuses at load, the plan refuses too, in the same words
    refuse_layers(config, base.layers)
    refuse_half(config, dtype)
    size = torch.empty((), dtype=dtype).element_size()

    def layer_bytes(layer: torch.nn.Module) -> int:
        total, experts = 0, {id(getattr(m, n)) for m, n in expert_weights(layer)}
        for name, p in layer.named_parameters():
            if id(p) in experts:  # [experts, rows, cols]: quantized as rows over the last dimension
                total += quantized_bytes(p.shape[:-1].numel(), p.shape[-1], quant, size)
                continue
            quantized = name.endswith("proj.weight") and p.dim() == 2
            total += quantized_bytes(*p.shape, quant, size) if quantized else p.numel() * size
        return total

    def scratch(layer: torch.nn.Module) -> int:  # its experts at full width while forwards run (`dequantized_bytes`)
        if quant == "none":
            return 0
        return EXPERT_COPIES * sum(getattr(m, n).numel() * size for m, n in expert_weights(layer))

    attention = next((layer.self_attn for layer in base.layers if hasattr(layer, "self_attn")), None)
    kv_heads, key_dim, value_dim = widest_kv(config) if takes_layer_inputs(config) else kv_dims(config, attention)
    per_position = kv_heads * (key_dim + value_dim) * size
    fields = {
        "kv_layer": tuple(per_position if hasattr(layer, "self_attn") else 0 for layer in base.layers),
        "window_layer": tuple(layer_windows(config)),
    }
    if takes_layer_inputs(config):  # widths per layer type, shared keys counted once, every position kept
        fields |= shape_fields(config, base, size)
    return ModelShape(
        layers=config.num_hidden_layers,
        layer=tuple(layer_bytes(layer) for layer in base.layers),
        embed=base.embed_tokens.weight.numel() * size,
        norm=base.norm.weight.numel() * size,
        lm_head=model.get_output_embeddings().weight.numel() * size,
        kv_per_position=per_position,
        hidden=config.hidden_size,
        intermediate=config.intermediate_size,
        heads=config.num_attention_heads,
        vocab=config.vocab_size,
        head_dim=int(fields.pop("head_dim", key_dim)),  # type: ignore[call-overload]
        tied=bool(getattr(config, "tie_word_embeddings", False)),
        state_layer=tuple(state_bytes(layer, size) for layer in base.layers),
        state_row=tuple(ring_row_bytes(layer, size) for layer in base.layers),
        experts_scratch=max(scratch(layer) for layer in base.layers),
        **fields,  # type: ignore[arg-type]
    )


def shard_weights(shape: ModelShape, layers: tuple[int, int], *, embed: bool, head: bool) -> int:
    """Bytes of layers [a, b) with the embedding / norm + LM head; with per-layer inputs, their slices, and the
    embedding on every shard (a tail embeds its rounds' ids), held once beside a tied LM head."""
    a, b = layers
    tokens = embed or bool(shape.per_layer)
    lm_head = 0 if shape.tied and tokens else shape.lm_head
    inputs = sum(shape.per_layer[a:b]) + shape.per_layer_norm if shape.per_layer else 0
    return sum(shape.layer[a:b]) + (shape.embed if tokens else 0) + (shape.norm + lm_head if head else 0) + inputs


def row_bytes(shape: ModelShape, tokens: int, length: int, logits: bool, dtype_bytes: int) -> int:
    """An estimate of what one more sequence adds to a batched forward of `tokens` tokens attending over `length`
    positions, as workers measure it (`sizing.row_bytes`, through the HF layers): its activations, its keys and
    values gathered from the pool and repeated for every query head, float32 scores and probabilities, and
    the graphs' output buffer (a tail's logits, as `sizing.slot_cost` counts them)."""
    acts = tokens * (6 * shape.hidden + 3 * shape.intermediate) * dtype_bytes
    gathered = length * (shape.kv_per_position + 2 * shape.heads * shape.head_dim * dtype_bytes)
    scores = shape.heads * tokens * length * (4 + dtype_bytes)
    out = tokens * (tokens * shape.vocab if logits else shape.hidden) * dtype_bytes
    return acts + gathered + scores + out + (tokens * shape.vocab * 4 if logits else 0)


def slot_bytes(
    shape: ModelShape,
    layers: tuple[int, int],
    positions: int,
    tokens: int,
    logits: bool,
    dtype_bytes: int,
    scratch: int = 0,
    window_slack: int | None = None,
) -> int:
    """Keys/values of one slot of `positions` (+ `scratch`, default the step's tokens) over layers [a, b), plus
    its row of a forward of `tokens` tokens (as `sizing.slot_cost`: a round's K+1, a drafter's 2 with K+2
    scratch)."""
    kv = kv_bytes(shape, layers, positions, scratch or tokens, window_slack)
    return kv + row_bytes(shape, tokens, positions, logits, dtype_bytes)


def kv_bytes(
    shape: ModelShape, layers: tuple[int, int], positions: int, scratch: int, window_slack: int | None = None
) -> int:
    """What one sequence's cache holds over layers [a, b): the attention layers' keys/values of `positions` +
    `scratch` rounded up to a multiple of 16, as a pool holds them (a windowed layer's: a ring of its window and
    max(window_slack, scratch), where shorter, as the engines keep them: workers/engine/rings.py), and the
    linear-attention layers' states (which do not grow) with the inputs of their last scratch + 2 positions (a static
    pool's ring: workers/engine/linear_pool.py)."""
    a, b = layers
    full, windows = slot_length(positions, scratch), shape.window_layer or (None,) * shape.layers
    slack = None if window_slack is None else max(window_slack, scratch)

    def held(window: int | None) -> int:
        return full if window is None or slack is None else min(full, ring_length(window, slack))

    kv = sum(per * held(w) for per, w in zip(shape.kv_layer[a:b], windows[a:b], strict=True))
    return kv + sum(shape.state_layer[a:b]) + (scratch + 2) * sum(shape.state_row[a:b])


@dataclass
class WorkerPlan:
    """One worker's memory: weights, and the slots its budget leaves room for (full-length and short ones of
    `short_len` positions, sized as workers size theirs: `sizing.split_slots`), each costing `full_slot` /
    `short_slot` bytes."""

    role: str
    budget: int
    layers: tuple[int, int]
    weights: int
    full_slot: int = 0
    short_slot: int = 0
    full: int = 0
    short: int = 0
    short_len: int = 0
    workspace: int = 0  # the least its budget keeps free beside weights and slots
    kv_slot: tuple[int, int] = (0, 0)  # keys/values alone of a full-length and a short slot
    context: int = 0  # what its process holds outside the allocator (settings.engine.cuda_context_gib)
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def slots(self) -> int:
        return self.full + self.short

    @property
    def caches(self) -> int:
        return self.full * self.full_slot + self.short * self.short_slot

    @property
    def kv(self) -> int:
        """The KV caches alone (what a worker's ready line calls its caches)."""
        return self.full * self.kv_slot[0] + self.short * self.kv_slot[1]

    @property
    def expected(self) -> int:
        """What the allocator holds at its peak: weights + slots (with their rows) + a prefill's workspace."""
        return min(self.budget - self.context, self.weights + self.caches + self.workspace)

    def as_dict(self) -> dict:
        return {**asdict(self), "slots": self.slots, "caches": self.caches, "kv": self.kv, "expected": self.expected}


@dataclass
class Plan:
    model: str
    dtype: str
    quant: str
    full_len: int
    workers: list[WorkerPlan]

    @property
    def in_flight(self) -> int:
        return min(w.slots for w in self.workers)

    def as_dict(self) -> dict:
        head = {k: v for k, v in asdict(self).items() if k != "workers"}
        return {**head, "in_flight": self.in_flight, "workers": [w.as_dict() for w in self.workers]}


Cost = Callable[[int], int]  # bytes of one slot of n positions


def fit(ws: list[WorkerPlan], cfg: Settings, full_len: int, slot: list[Cost], kv: list[Cost]) -> list[WorkerPlan]:
    """Fill each worker's budget as workers do (`sizing.split_slots`): long_slots_share of what the weights leave
    (less the reserve) in full-length slots, at least one, the rest in short ones (`slot` bytes and `kv` bytes of
    keys/values a slot of n positions), shorter where max_slots do not fit; several workers (a head and its
    drafter on a GPU of its own) hold as many as all of them do, as a head sizes them; none if even one
    full-length slot does not fit."""
    lefts = []
    for w, cost, keys in zip(ws, slot, kv, strict=True):
        w.context = int(cfg.engine.cuda_context_gib * GiB)
        w.full_slot, w.kv_slot = cost(full_len), (keys(full_len), 0)
        left = w.budget - w.context - w.weights
        lefts.append(left - reserve_bytes(left, w.workspace, cfg))
    if any(left < w.full_slot for left, w in zip(lefts, ws, strict=True)):
        return ws
    got = split_slots(list(zip(lefts, slot, strict=True)), full_len, cfg)
    for w, cost, keys in zip(ws, slot, kv, strict=True):
        w.full, w.short, w.short_len = got.slots, got.short, got.short_len
        if got.short_len:
            w.short_slot, w.kv_slot = cost(got.short_len), (w.kv_slot[0], keys(got.short_len))
    return ws


@dataclass(frozen=True)
class Piece:
    """What one device of a worker holds: weights, what a slot of n positions costs there (with its rows of a
    forward) and its keys/values alone, the workspace it keeps free; `parts`: the weights by model."""

    layers: tuple[int, int]
    weights: int
    slot: Cost
    kv: Cost
    workspace: int
    parts: dict[str, int] = field(default_factory=dict)


class Costs:
    """A model's (and its drafter's) costs on a worker's device, as workers count them at start
    (`worker_needs`): `piece` for layers [a, b) with the embedding / norm + LM head / the drafter, `fit` for the
    slots that pieces' budgets hold. `plan_split` and the N-stage plan (workers/engine/plan_stages.py) both use it."""

    def __init__(
        self,
        config: PretrainedConfig,
        dtype: torch.dtype,
        quant: str,
        draft: PretrainedConfig | None,
        draft_quant: str,
        settings: Settings,
    ) -> None:
        cfg = self.settings = settings
        self.shape, self.size = model_shape(config, dtype, quant), torch.empty((), dtype=dtype).element_size()
        self.full_len = min(cfg.engine.max_len, getattr(config, "max_position_embeddings", None) or cfg.engine.max_len)
        self.k, self.slack = cfg.engine.graph_k, cfg.engine.window_slack
        self.workspace = workspace_bytes(config, self.size, cfg) + self.shape.experts_scratch
        self.dshape = model_shape(draft, dtype, draft_quant) if draft is not None else None
        self.draft_workspace = (
            workspace_bytes(draft, self.size, cfg) + self.dshape.experts_scratch if self.dshape is not None else 0
        )

    def slots(self, sh: ModelShape, layers: tuple[int, int], tokens: int, logits: bool, scratch: int = 0) -> Cost:
        size, slack = self.size, self.slack
        return lambda p: slot_bytes(sh, layers, p, tokens, logits, size, scratch, slack)

    def kv(self, sh: ModelShape, layers: tuple[int, int], scratch: int) -> Cost:
        slack = self.slack
        return lambda p: kv_bytes(sh, layers, p, scratch, slack)

    def drafter(self) -> Piece:
        """The draft model: a slot, and a whole draft's copy of its rows' keys and values
        (`sizing.engine_slot_cost`); an empty piece without one."""
        if self.dshape is None:
            return Piece((0, 0), 0, lambda _: 0, lambda _: 0, 0)
        d, k, layers = self.dshape, self.k, (0, self.dshape.layers)
        weights = shard_weights(d, layers, embed=True, head=True)
        copy = self.kv(d, layers, 2 + k)
        slot = self.slots(d, layers, 2, True, 2 + k)
        return Piece(layers, weights, lambda p: slot(p) + copy(p), copy, self.draft_workspace)

    def piece(self, layers: tuple[int, int], *, embed: bool, head: bool, draft: bool = False) -> Piece:
        """Layers [a, b) of the target, with its embedding (`embed`), its norm + LM head (`head`, whose slots'
        rows carry logits), and the drafter beside them (`draft`: a head's, on its device)."""
        sh, k = self.shape, self.k
        weights = shard_weights(sh, layers, embed=embed, head=head)
        own = Piece(layers, weights, self.slots(sh, layers, k + 1, head), self.kv(sh, layers, k + 1), self.workspace)
        if not draft:
            return own
        d = self.drafter()
        return Piece(
            layers,
            own.weights + d.weights,
            lambda p: own.slot(p) + d.slot(p),
            lambda p: own.kv(p) + d.kv(p),
            max(own.workspace, d.workspace),
            {"layers": own.weights, "draft": d.weights},
        )

    def fit(self, placed: list[tuple[str, int, Piece]]) -> list[WorkerPlan]:
        """Pieces on budgets (role, bytes, piece), sized together as one worker's devices (`fit`)."""
        ws = [WorkerPlan(r, b, p.layers, p.weights, workspace=p.workspace, parts=dict(p.parts)) for r, b, p in placed]
        pieces = [p for _, _, p in placed]
        return fit(ws, self.settings, self.full_len, [p.slot for p in pieces], [p.kv for p in pieces])


def plan_split(
    config: PretrainedConfig,
    gpus: list[int],
    *,
    dtype: torch.dtype,
    quant: str = "none",
    draft: PretrainedConfig | None = None,
    draft_quant: str = "none",
    settings: Settings | None = None,
    name: str = "",
    split: int | None = None,
) -> Plan:
    """The head/tail split (layers 0:s and s:L) that holds the most jobs in flight on GPUs of `gpus` bytes
    (head, tail, and optionally the drafter's own GPU), or the one `split` names, and each worker's memory."""
    if len(gpus) not in (2, 3):
        raise ModelLoadError("a plan needs 2 GPUs (head, tail) or 3 (head, tail, the head's drafter)")
    cfg = settings or Settings()
    costs = Costs(config, dtype, quant, draft, draft_quant, cfg)
    n = costs.shape.layers
    if n < 2:
        raise ModelLoadError(f"a model of {n} layer cannot be split between a head and a tail")

    def workers(s: int) -> list[WorkerPlan]:
        tail = costs.piece((s, n), embed=False, head=True)
        if len(gpus) == 2 or costs.dshape is None:  # the drafter beside the head's layers
            out = costs.fit([("head", gpus[0], costs.piece((0, s), embed=True, head=False, draft=True))])
        else:  # the drafter on a GPU of its own: as many slots as both hold (`head.runtime._joint_slots`)
            own = costs.piece((0, s), embed=True, head=False)
            out = costs.fit([("head", gpus[0], own), ("draft", gpus[2], costs.drafter())])
        return [*out, *costs.fit([("tail", gpus[1], tail)])]

    if split is not None and not 0 < split < n:
        raise ModelLoadError(f"a split at layer {split} leaves a worker without layers (the model has {n})")
    cuts = plan_cuts(config, split)  # each, but where it parts a Gemma 4 shared layer from its source (refused)
    best = split or max(cuts, key=lambda s: (min(w.slots for w in workers(s)), -abs(n - 2 * s)))
    return Plan(name, str(dtype).removeprefix("torch."), quant, costs.full_len, workers(best))


def enforce_budget(device: torch.device, settings: Settings) -> None:
    """Cap the CUDA caching allocator at the worker's `allocator_budget` (`set_per_process_memory_fraction`), so
    weights, caches, graph pools and workspaces together never pass it, nor the process its --gpu-memory."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        allowed = allocator_budget(device, settings) or total
        torch.cuda.set_per_process_memory_fraction(min(1.0, allowed / total), device)


@dataclass(frozen=True)
class Part:
    """What a worker loads of one model: its config, layers, embedding / LM head, dtype and quantization."""

    config: PretrainedConfig
    layers: tuple[int, int]
    embed: bool
    head: bool
    dtype: torch.dtype
    quant: str = "none"


def worker_needs(parts: list[Part], settings: Settings) -> tuple[int, int, int]:
    """(weights, one full-length slot, workspace) in bytes for a worker holding `parts` (a head: its layers and
    drafter)."""
    weights = slot = workspace = 0
    for i, p in enumerate(parts):
        shape, size = model_shape(p.config, p.dtype, p.quant), torch.empty((), dtype=p.dtype).element_size()
        workspace = max(workspace, workspace_bytes(p.config, size, settings) + shape.experts_scratch)
        weights += shard_weights(shape, p.layers, embed=p.embed, head=p.head)
        n = min(settings.engine.max_len, getattr(p.config, "max_position_embeddings", None) or 1 << 30)
        k = settings.engine.graph_k  # a round of K+1 tokens, or a drafter's feed of 2 with K+2 positions of scratch
        tokens, scratch = (k + 1, k + 1) if i == 0 else (2, k + 2)
        slack = settings.engine.window_slack
        slot += slot_bytes(shape, p.layers, n, tokens, p.head, size, scratch, slack)
        if i > 0:  # a drafter's whole drafts: a copy of its rows' keys and values (`sizing.engine_slot_cost`)
            slot += kv_bytes(shape, p.layers, n, scratch, slack)
    return weights, slot, workspace


def check_worker(role: str, parts: list[Part], device: torch.device, settings: Settings) -> None:
    """Refuse, before anything loads, a worker whose weights and one full-length cache slot do not fit its
    budget (`sizing.allocator_budget`), with the numbers."""
    budget = allocator_budget(device, settings)
    if budget is None:
        return
    weights, slot, workspace = worker_needs(parts, settings)
    reserve = reserve_bytes(budget - weights, workspace, settings)
    if budget - weights - reserve < slot:
        raise ModelLoadError(
            f"the {role} does not fit its memory budget: weights {gb(weights)} GiB + one cache slot of "
            f"{settings.engine.max_len} positions {gb(slot)} GiB + workspace {gb(reserve)} GiB > budget "
            f"{gb(budget)} GiB (raise --gpu-memory, quantize with --quant, or give this worker fewer layers; "
            "`shardflow plan` shows a split)"
        )


def gb(n: float) -> str:
    return f"{n / GiB:.2f}"
