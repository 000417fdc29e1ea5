"""Gemma 4's text layers (`gemma4_text`, and the text model of `Gemma4ForConditionalGeneration`): what they take
beyond the hidden states, and how a split keeps them exact.

- Per-layer inputs (`hidden_size_per_layer_input`): each decoder layer adds a residual signal made from the token
  ids (their row of `embed_tokens_per_layer`, one table packed [vocab, layers x width]) and from the scaled token
  embeddings (`per_layer_model_projection`, then `per_layer_projection_norm`): (projection + table row) / sqrt(2).
  Every shard computes those of its own layers (`PerLayerInputs`), holding only its layers' columns of the packed
  table and rows of the projection (read as slices: `checkpoint.read_slice`). A tail gets no token embeddings from
  the head, but each round's packet carries the ids of its hidden rows (`input_ids` + `draft_ids`), so a tail is
  passed them (`Shard.forward(..., ids=)`, `Engine.forward_many(..., ids=)`, workers/tail/rounds.py `round_ids`)
  and embeds them itself: with its tied LM head's weight, else the embedding read for it.
- Keys and values shared across layers (`num_kv_shared_layers`): the last N layers compute none; each attends over
  those the last earlier layer of its type returned in the same forward (transformers' `shared_kv_states`, filled
  where `store_full_length_kv` is set). So a shared layer runs in the shard of its source: `refuse_split` refuses
  at load a range that parts them, naming the layer, and `shardflow plan` cuts only where none is parted
  (`legal_cuts`). Shared layers write nothing to a cache; the plan counts their keys once (`shape_fields`).
- A wider head on full attention (`global_head_dim`), keys as values (`attention_k_eq_v`), double-wide MLPs on
  shared layers, a mixture of experts beside the MLP (`enable_moe_block`): transformers' own layers run them, over
  the masks a shard builds (sliding windows as Gemma 3's); the final logit soft cap is `Shard._logits`'.

Such shards run transformers' layers over static caches as every family does (a batch of sequences in one forward):
the pool holds each layer's own head width and key/value heads and nothing for a KV-shared layer (`cached_dims`), and
a tail's batch carries its rows' ids (`Engine.forward_many(..., ids=)`, a graph's `BatchGraph.ids`). CUDA graphs run
by default on a CUDA device, except for the mixture-of-experts variant in float32, whose experts' grouped products copy
a host tensor while captured (`graphs_reason`, `sizing.cache_modes`). A rejected draft rolls back as for any other
family.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig

from schemas.errors import ModelLoadError
from workers.engine.checkpoint import Source, materialise, prefix_of, read_slice

# families whose layers take inputs beyond the hidden states (per-layer inputs, keys and values of another layer)
LAYER_INPUTS = {"gemma4_text"}
NO_GRAPHS = (
    "{}'s mixture-of-experts layers in float32 run CUDA graphs only where asked (--graphs): captured in float32 their "
    "experts' grouped products copy a host tensor (run 116); in bfloat16 they capture (run 121)"
)


def graphs_reason(config: PretrainedConfig, dtype: torch.dtype) -> str | None:
    """Why a shard of this family in `dtype` runs CUDA graphs only where asked, or None: its mixture-of-experts variant
    in float32 (transformers runs the experts' grouped products there through a path that reads the group offsets on
    the host; in bfloat16 they run `grouped_mm` on the device)."""
    moe = getattr(config, "enable_moe_block", False)
    return NO_GRAPHS.format(config.model_type) if moe and dtype == torch.float32 else None


def takes_layer_inputs(config: PretrainedConfig) -> bool:
    """Whether the family's layers take inputs beyond the hidden states (`LAYER_INPUTS`)."""
    return config.model_type in LAYER_INPUTS


def per_layer_width(config: PretrainedConfig) -> int:
    """The width of each layer's per-layer input (0: the model has none)."""
    return int(getattr(config, "hidden_size_per_layer_input", 0) or 0) if takes_layer_inputs(config) else 0


def id_limit(config: PretrainedConfig) -> int:
    """The token ids a shard of this model takes are below this: its vocabulary, and the rows of its per-layer table
    where it has one (`vocab_size_per_layer_input`, which transformers indexes unchecked: an id past it is an
    IndexError on a CPU, and on CUDA a device-side assert that takes the whole process down)."""
    if not per_layer_width(config):
        return config.vocab_size
    return min(config.vocab_size, config.vocab_size_per_layer_input)


def kv_sources(config: PretrainedConfig) -> dict[int, int]:
    """Each KV-shared layer -> the layer whose keys and values it attends over: the last layer of its type before
    the shared ones (as transformers' Gemma 4 attention marks it `store_full_length_kv`); ModelLoadError, naming
    it, for a shared layer no earlier layer of its type feeds."""
    n = config.num_hidden_layers
    first = n - (getattr(config, "num_kv_shared_layers", 0) or 0)
    if not takes_layer_inputs(config) or not 0 < first < n:
        return {}
    types, out = config.layer_types, {}
    for i in range(first, n):
        if (j := max((j for j in range(first) if types[j] == types[i]), default=None)) is None:
            raise ModelLoadError(
                f"{config.model_type}: layer {i} shares the keys and values of an earlier {types[i]} layer, and "
                f"layers 0:{first} have none"
            )
        out[i] = j
    return out


def parted(config: PretrainedConfig, layers: tuple[int, int]) -> tuple[int, int] | None:
    """(shared layer, its source) of the first pair that layers [a, b) part (one inside, one outside), or None."""
    a, b = layers
    return next(((i, j) for i, j in kv_sources(config).items() if (a <= i < b) != (a <= j < b)), None)


def legal_cuts(config: PretrainedConfig) -> list[int]:
    """The layers s at which a head 0:s / tail s:L split parts no shared layer from its source."""
    return [s for s in range(1, config.num_hidden_layers) if parted(config, (0, s)) is None]


def plan_cuts(config: PretrainedConfig, split: int | None = None) -> list[int]:
    """The cuts `shardflow plan` may choose among (`legal_cuts`); ModelLoadError, naming the layer, for a `split` it
    was asked for that parts a shared layer from its source, or when no cut keeps them together."""
    if split is not None:
        refuse_split(config, (split, config.num_hidden_layers))
    cuts = legal_cuts(config)
    if not cuts:
        raise ModelLoadError(f"no head/tail split keeps each of {config.model_type}'s shared layers beside its source")
    return cuts


def refuse_split(config: PretrainedConfig, layers: tuple[int, int]) -> None:
    """ModelLoadError, naming the layer, for a shard of layers [a, b) that parts a KV-shared layer from its source."""
    pair = parted(config, layers)
    if pair is None:
        return
    (i, j), (a, b) = pair, layers
    cuts = ", ".join(map(str, legal_cuts(config))) or "none"
    raise ModelLoadError(
        f"{config.model_type}: layer {i} attends over the keys and values layer {j} computes "
        f"(num_kv_shared_layers={config.num_kv_shared_layers}), so both must run in one shard; layers {a}:{b} part "
        f"them (head/tail splits that keep them together: at layer {cuts})"
    )


class PerLayerInputs(nn.Module):
    """The per-layer inputs of a shard's `count` layers from token ids and their scaled embeddings, as transformers'
    `get_per_layer_inputs` + `project_per_layer_inputs` compute them, over the shard's slices of the packed weights."""

    def __init__(
        self,
        config: PretrainedConfig,
        count: int,
        tokens: nn.Module,
        table: nn.Module,
        projection: nn.Module,
        norm: nn.Module,
    ) -> None:
        super().__init__()
        self.tokens, self.table, self.projection, self.norm = tokens, table, projection, norm
        self.count, self.width = count, per_layer_width(config)
        self.projection_scale = config.hidden_size**-0.5
        self.input_scale = 2.0**-0.5

    def forward(self, ids: torch.Tensor, embeds: torch.Tensor | None = None) -> torch.Tensor:
        """[*ids.shape, count, width] from ids and their scaled embeddings (embedded here when not given)."""
        embeds = self.tokens(ids) if embeds is None else embeds
        shape = (*ids.shape, self.count, self.width)
        projected = self.norm((self.projection(embeds) * self.projection_scale).reshape(shape))
        return (projected + self.table(ids).reshape(shape)) * self.input_scale


class LayerInputs(nn.Module):
    """What each of a shard's layers takes beyond the hidden states: its per-layer input (where the model has them)
    and the one dict of a forward through which a KV-shared layer reads the keys and values of its source."""

    def __init__(self, count: int, per_layer: PerLayerInputs | None) -> None:
        super().__init__()
        self.count, self.per_layer = count, per_layer

    @property
    def needs_ids(self) -> bool:
        """Whether the inputs are made from token ids (a shard without the embedding must be given them)."""
        return self.per_layer is not None

    def forward(self, ids: torch.Tensor | None, embeds: torch.Tensor | None) -> list[dict[str, object]]:
        """Each layer's keyword arguments for one forward over ids ([B, T]; None where not needed), whose scaled
        embeddings are `embeds` (None: embedded here)."""
        shared: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        if self.per_layer is None:
            return [{"shared_kv_states": shared} for _ in range(self.count)]
        if ids is None:
            raise ValueError("this shard's layers take per-layer inputs: pass the token ids of its rows (ids=)")
        inputs = self.per_layer(ids, embeds)
        return [{"per_layer_input": inputs[..., j, :], "shared_kv_states": shared} for j in range(self.count)]


def load_layer_inputs(
    skeleton: nn.Module,
    config: PretrainedConfig,
    layers: tuple[int, int],
    *,
    tokens: nn.Module | None,
    tied_head: nn.Module | None,
    files: dict[str, Path],
    aliases: dict[str, str],
    weights: Source,
    dtype: torch.dtype,
    device: str,
) -> LayerInputs:
    """The `LayerInputs` of layers [a, b) of `skeleton` (built on the meta device): their columns of the packed
    per-layer table and rows of its projection read as slices (from `files`, else cut from `weights`), the norm, and
    the token embedding: `tokens` (the shard's own), else `tied_head`'s weight, else the embedding read."""
    a, b = layers
    width = per_layer_width(config)
    if not width:
        return LayerInputs(b - a, None)
    base = skeleton.get_decoder()
    table, projection = base.embed_tokens_per_layer, base.per_layer_model_projection
    norm = base.per_layer_projection_norm
    lo, hi = a * width, b * width

    def part(module: nn.Module, dim: int) -> nn.Parameter:
        name = f"{prefix_of(skeleton, module)}weight"
        if files:
            got = read_slice(files, aliases.get(name, name), dim, lo, hi, dtype, device)
        else:  # weights from elsewhere (a plugin's source): read whole, keep the slice
            whole = weights({"weight": name}, {"weight": tuple(module.weight.shape)}, dtype, device)["weight"]
            got = whole.narrow(dim, lo, hi - lo).contiguous()
        return nn.Parameter(got, requires_grad=False)

    table.weight, table.embedding_dim = part(table, 1), hi - lo
    projection.weight, projection.out_features = part(projection, 0), hi - lo
    materialise(norm, prefix_of(skeleton, norm), weights, dtype, device)
    if tokens is None:  # a tail: the scaled embedding, its tied LM head's weight where it has one
        tokens = base.embed_tokens
        if tied_head is not None:
            tokens.weight = tied_head.weight
        else:
            materialise(tokens, "", weights, dtype, device, {"weight": f"{prefix_of(skeleton, tokens)}weight"})
    return LayerInputs(b - a, PerLayerInputs(config, b - a, tokens, table, projection, norm))


def cached_dims(shard: nn.Module) -> dict[int, tuple[int, int, int]] | None:
    """Where widths vary by layer (`LAYER_INPUTS`): each layer that caches keys and values -> (key/value heads, key
    width, value width) as its attention module has them. A KV-shared layer caches none: it reads its source's,
    returned by the source's cache update within the same forward. None for other families (one width for all)."""
    if not takes_layer_inputs(shard.config):
        return None
    attending = [layer.self_attn for layer in shard.layers if not layer.self_attn.is_kv_shared_layer]
    return {a.layer_idx: (a.k_proj.out_features // a.head_dim, a.head_dim, a.head_dim) for a in attending}


def widest_kv(config: PretrainedConfig) -> tuple[int, int, int]:
    """(key/value heads, key width, value width) of the layer that caches the most a position: Gemma 4's head width
    and key/value heads vary by layer type (its config refuses to give one global `head_dim`)."""
    layers = [config.per_layer_config[i] for i in range(config.num_hidden_layers)]
    heads, width = max(((c.num_key_value_heads, c.head_dim) for c in layers), key=lambda d: d[0] * d[1])
    return heads, width, width


def widest_mlp(config: PretrainedConfig) -> int:
    """The widest intermediate one layer computes a token: double-wide MLPs on shared layers, beside a mixture of
    experts' top-k (`enable_moe_block`)."""
    mlp = config.intermediate_size * (2 if getattr(config, "use_double_wide_mlp", False) else 1)
    moe = config.top_k_experts * config.moe_intermediate_size if getattr(config, "enable_moe_block", False) else 0
    return mlp + moe


def shape_fields(config: PretrainedConfig, base: nn.Module, dtype_bytes: int) -> dict[str, object]:
    """`plan.ModelShape`'s fields for these families: the widest head, each layer's keys + values a position at its
    own head width (0 for a KV-shared layer: its source's are counted), and the bytes of each layer's per-layer-input
    weights (its columns of the table, rows of the projection) and the norm."""
    n, width = config.num_hidden_layers, per_layer_width(config)
    kv = tuple(
        0 if layer.self_attn.is_kv_shared_layer else 2 * layer.self_attn.k_proj.out_features * dtype_bytes
        for layer in base.layers
    )
    per_layer = width * (config.vocab_size_per_layer_input + config.hidden_size) * dtype_bytes
    return {
        "head_dim": max(config.per_layer_config[i].head_dim for i in range(n)),  # the widest (full attention's)
        "kv_layer": kv,
        "per_layer": (per_layer,) * n if width else (),
        "per_layer_norm": width * dtype_bytes,
    }
