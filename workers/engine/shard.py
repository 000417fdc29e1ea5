"""Load a slice of a Hugging Face causal LM's layers and run it.

`load_shard(model, (a, b), embed=..., head=...)` builds the model skeleton on the meta device and
materialises only layers [a, b) (plus the embedding and/or final norm + LM head when asked), reading
just those tensors from the safetensors files. Tied embeddings are handled: a tail's LM head is read
from the embedding tensor. Families laid out like Qwen2 / Llama load (their parameters built on the meta device,
their computed buffers real); sliding windows run for the families in workers/engine/windows.py (on static caches
in rings of window + slack positions: workers/engine/rings.py). Layers that take more than the hidden states (Gemma 4's
per-layer inputs and keys shared across layers) get them from `Shard.layer_inputs` (workers/engine/per_layer.py).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from schemas.errors import ModelLoadError
from schemas.settings import EngineSettings
from workers.engine import attention, decode_kernels, pool_attention
from workers.engine.checkpoint import (
    Source,
    materialise,
    materialise_rest,
    parameters_on_meta,
    prefix_of,
    read_raw,
    read_tensors,
    resolve_model_dir,
    weight_files,
)
from workers.engine.convert import converted_names, converting_source
from workers.engine.decode_kernels import DecodeLayers
from workers.engine.fused import FusedLayers, can_fuse, fuse_layer, fused_stack
from workers.engine.kvcache import BatchView, KVCache, StaticKVCache
from workers.engine.linear_pool import pool_backed
from workers.engine.per_layer import LayerInputs, graphs_reason, load_layer_inputs, refuse_split, takes_layer_inputs
from workers.engine.quant import check_scheme, prequantized_layer, prequantized_scheme, quantize_layer, state_bytes
from workers.engine.quant_experts import quantize_experts
from workers.engine.recurrent import RecurrentCache, linear_layers
from workers.engine.refusals import refuse_half, refuse_layers, refuse_layout, refuse_windows
from workers.engine.windows import layer_windows
from workers.engine.wrappers import stored_aliases, text_config

Cache = KVCache | StaticKVCache
# Steps whose float32 attention scores (batch x heads x tokens x cached positions) would take more than
# this run through the HF layers (long or many prompt prefills), whose attention kernel does not
# materialise them as the fused path's GEMM attention does. Rounds always fit: 16 sequences x 9 tokens
# of a 7B shard (28 heads) over 8,192 positions take 132 MB; one 7B prefill may be 1,170 tokens over
# 2,048 positions, 292 over 8,192.
FUSED_MAX_SCORE_BYTES = 256 << 20


class Shard(nn.Module):
    """Layers [start, end) of a causal LM, optionally with the embedding and/or norm + LM head."""

    def __init__(
        self,
        config: PretrainedConfig,
        layer_range: tuple[int, int],
        layers: nn.ModuleList,
        rotary: nn.Module,
        embed: nn.Module | None,
        norm: nn.Module | None,
        lm_head: nn.Module | None,
    ) -> None:
        super().__init__()
        self.config, self.layer_range = config, layer_range
        self.layers, self.rotary, self.embed, self.norm, self.lm_head = layers, rotary, embed, norm, lm_head
        # each layer's attention window (None: it sees every earlier position), as the config's layer types say
        self.windows: list[int | None] = layer_windows(config)[layer_range[0] : layer_range[1]]
        # each layer's type, where the rotary module takes one (a rotary per layer type), else None
        takes_type = "layer_type" in inspect.signature(rotary.forward).parameters
        self.layer_types: list[str] | None = (
            list(config.layer_types[layer_range[0] : layer_range[1]]) if takes_type else None
        )
        self.layer_inputs: LayerInputs | None = None  # Gemma 4's per-layer inputs and shared KV (per_layer.py)
        self.fused: FusedLayers | None = None  # the lean forward of workers/engine/fused.py, when set (load_shard)
        self.quant = "none"  # how its layers' linears are stored (workers/engine/quant.py), set by load_shard
        self._dtype: torch.dtype | None = None  # the compute dtype (quantized weights are stored otherwise)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        if self._dtype is None:
            self._dtype = next(p.dtype for p in self.parameters() if p.is_floating_point())
        return self._dtype

    def weight_bytes(self) -> int:
        """Bytes its weights hold on its device (quantized linears' statistics included; tied tensors once)."""
        tensors = {t.data_ptr(): t for t in (*self.parameters(), *self.buffers())}
        return sum(t.numel() * t.element_size() for t in tensors.values()) + state_bytes(self)

    def forward(
        self, x: torch.Tensor, start_pos: int, cache: Cache, logits_last: int = 0, ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Run the shard over x (token ids [n] with an embedding, else hidden states [n, h]).

        Positions are start_pos..start_pos+n-1 and `cache` must hold exactly start_pos positions.
        Returns hidden states [n, h], or logits [logits_last, vocab] of the last rows when the shard
        has an LM head and logits_last > 0. `ids` ([n]): the token ids of x's rows, which a shard without the
        embedding whose layers take per-layer inputs needs (`needs_ids`), ignored elsewhere.
        """
        if cache.length != start_pos:
            raise ValueError(f"cache holds {cache.length} positions, round starts at {start_pos}")
        n = x.shape[0]
        if isinstance(cache, RecurrentCache):
            cache.begin(x, start_pos)
        out = self.run(x, cache.positions(start_pos, n, x.device), cache, logits_last, ids)
        if isinstance(cache, StaticKVCache):
            cache.advance(start_pos + n)
        elif isinstance(cache, RecurrentCache):
            cache.end(n)
        return out

    @property
    def needs_ids(self) -> bool:
        """Whether a forward must be given its rows' token ids beside hidden states (Gemma 4's per-layer inputs)."""
        return self.embed is None and self.layer_inputs is not None and self.layer_inputs.needs_ids

    @property
    def graphs_reason(self) -> str | None:
        """Why this shard runs graphs only where asked (sizing.py), or None: Gemma 4's MoE variant in float32."""
        return graphs_reason(self.config, self.dtype) if self.layer_inputs is not None else None

    @property
    def recurrent(self) -> bool:
        """Whether some layer keeps a recurrent state (linear attention: linear_pool.py, recurrent.py)."""
        return bool(linear_layers(self.layers))

    def new_cache(self) -> KVCache:
        """A dynamic cache for one sequence: a `RecurrentCache` (rolled back by replay) where layers keep a state."""
        linear = linear_layers(self.layers)
        return RecurrentCache(linear, lambda x, start, cache: self.forward(x, start, cache)) if linear else KVCache()

    def run(
        self, x: torch.Tensor, pos: torch.Tensor, cache: Cache, logits_last: int = 0, ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The forward itself, over device positions `pos`; no host syncs, so it can be graph-captured."""
        h = self._embed(x)[None] if self.embed is not None else x[None]
        extra = self._extra(x[None], h, ids[None] if ids is not None else None)
        h = self._layers(h, pos[None], self._masks(cache, pos), cache, extra)[0]
        if self.lm_head is None or logits_last <= 0:
            return h
        return self._logits(h[-logits_last:])

    def run_batch(
        self,
        x: torch.Tensor,
        pos: torch.Tensor,
        view: BatchView,
        pick: torch.Tensor | None = None,
        ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """B sequences at once: x is [B, T] token ids (or [B, T, h] hidden states, with their ids [B, T] where
        `needs_ids`), pos [B, T].

        Returns hidden states [B, T, h], or with `pick` ([B, P] row indices) and an LM head the
        logits [B, P, vocab] of those rows. No host syncs: graph-capturable."""
        h = self._embed(x) if self.embed is not None else x
        h = self._layers(h, pos, self._masks(view, pos), view, self._extra(x, h, ids))
        if pick is None or self.lm_head is None:
            return h
        rows = torch.arange(h.shape[0], device=h.device)[:, None]
        return self._logits(h[rows, pick])

    def _extra(self, x: torch.Tensor, h: torch.Tensor, ids: torch.Tensor | None) -> list[dict[str, object]] | None:
        """Each layer's keyword arguments beyond the hidden states (workers/engine/per_layer.py), None for most
        families: from x and its embeddings h where the shard embeds, else from the ids given."""
        if self.layer_inputs is None:
            return None
        return self.layer_inputs(x, h) if self.embed is not None else self.layer_inputs(ids, None)

    def _embed(self, x: torch.Tensor) -> torch.Tensor:
        """Token embeddings, scaled as the model's own forward scales them (Granite's `embedding_multiplier`)."""
        assert self.embed is not None
        scale = getattr(self.config, "embedding_multiplier", None)
        return self.embed(x) * scale if scale not in (None, 1, 1.0) else self.embed(x)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """The LM head over the final norm, scaled and capped as the model's own forward does: Cohere's
        `logit_scale`, Granite's `logits_scaling` (a divisor), Gemma 2's final soft cap."""
        assert self.lm_head is not None and self.norm is not None
        logits, cfg = self.lm_head(self.norm(h)), self.config
        if (scale := getattr(cfg, "logit_scale", None)) not in (None, 1, 1.0):
            logits = logits * scale
        if (divisor := getattr(cfg, "logits_scaling", None)) not in (None, 1, 1.0):
            logits = logits / divisor
        cap = getattr(cfg, "final_logit_softcapping", None)
        return torch.tanh(logits / cap) * cap if cap else logits

    @property
    def windowed(self) -> bool:
        """Whether some layer of the shard attends within a sliding window."""
        return any(w is not None for w in self.windows)

    @property
    def attends_in_place(self) -> bool:
        """Whether batches over a pool attend where their keys and values sit (workers/engine/pool_attention.py):
        no gathered copies, no attended-length buckets, no score buffers (any length runs the fused layers)."""
        return self.fused is not None and self.fused.kernel is not None

    def set_attention(self, mode: str) -> None:
        """EngineSettings.attention on the fused layers: gather turns attention in place off, in_place turns it on
        with the reference kernel where FlashAttention does not run, auto keeps what the load probed."""
        if self.fused is None or mode == "auto" or self.windowed or self.fused.sinks:
            return  # a windowed shard attends through masks over gathered keys and values (`_masks`), sinks too
        if mode == "gather":
            self.fused.kernel = None
        elif self.fused.kernel is None:
            self.fused.kernel = pool_attention.reference

    def set_decode_kernels(self, on: bool, rows: int | None = None) -> bool:
        """Steps of up to `rows` token rows (None: EngineSettings.draft_kernel_rows) through decode_kernels.py where
        Triton runs, every fused layer qualifies and steps through them agree with the fused forward; whether on."""
        fused = self.fused
        if fused is None:
            return False
        fused.decode = None
        if not on or fused.kernel is None or self.windowed or not decode_kernels.available(self.device):
            return False
        rows = EngineSettings().draft_kernel_rows if rows is None else rows
        decode = DecodeLayers.for_layers(fused, rows)
        fused.decode = decode if decode is not None and decode_kernels.agrees(self, decode) else None
        return fused.decode is not None

    def _masks(self, cache: object, pos: torch.Tensor) -> list[torch.Tensor | None]:
        """Each layer's attention mask over `cache` (one per distinct window, shared by its layers)."""
        made = {w: cache.mask(pos, w) for w in dict.fromkeys(self.windows)}  # type: ignore[attr-defined]
        return [made[w] for w in self.windows]

    def _fused_fits(self, h: torch.Tensor, masks: list[torch.Tensor | None], cache: object = None) -> bool:
        assert self.fused is not None
        if cache is not None and self.fused.attends_in_place(cache):
            return True
        positions = max((m.shape[-1] for m in masks if m is not None), default=h.shape[1])  # the widest layer's
        return h.shape[0] * self.fused.heads * h.shape[1] * positions * 4 <= FUSED_MAX_SCORE_BYTES

    def _layers(
        self,
        h: torch.Tensor,
        pos: torch.Tensor,
        masks: list[torch.Tensor | None],
        cache: object,
        extra: list[dict[str, object]] | None = None,
    ) -> torch.Tensor:
        rotary_pos = pos[None].expand(3, *pos.shape) if hasattr(self.rotary, "mrope_section") else pos  # Qwen3.5
        if self.layer_types is None:
            cos_sin = self.rotary(h, rotary_pos)
            if self.fused is not None and self._fused_fits(h, masks, cache):
                return self.fused(h, cos_sin, masks, cache)
            by_layer = [cos_sin] * len(self.layers)
        else:  # a rotary per layer type (Gemma 3's local and global bases, OLMo 3's)
            made = {t: self.rotary(h, pos, t) for t in dict.fromkeys(self.layer_types)}
            by_layer = [made[t] for t in self.layer_types]
            if self.fused is not None and self._fused_fits(h, masks, cache):
                return self.fused(h, by_layer, masks, cache)
        for j, (layer, mask, cos_sin) in enumerate(zip(self.layers, masks, by_layer, strict=True)):
            h = layer(
                h,
                attention_mask=mask if hasattr(layer, "self_attn") else None,  # a linear layer: no padding here
                position_embeddings=cos_sin,
                position_ids=pos,
                past_key_values=cache,
                use_cache=True,
                **(extra[j] if extra is not None else {}),
            )
        return h


def blank_input(shard: Shard, b: int, t: int) -> torch.Tensor:
    """Zeros shaped as a batch of b rows x t tokens this shard takes: token ids, or hidden states without an
    embedding."""
    if shard.embed is not None:
        return torch.zeros(b, t, dtype=torch.long, device=shard.device)
    return torch.zeros(b, t, shard.config.hidden_size, dtype=shard.dtype, device=shard.device)


def load_shard(
    model: str | Path,
    layers: tuple[int, int] | None = None,
    *,
    embed: bool,
    head: bool,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    fused: bool = True,
    source: tuple[PretrainedConfig, Source] | None = None,
    quant: str = "none",
) -> Shard:
    """Load layers [a, b) (None = all) of `model`, plus its embedding and/or norm + LM head.

    `model` is a local directory or hub id; `source` (config, weights) replaces it with weights from
    elsewhere (a plugin's model scheme, workers/plugins.py; `model` is then only its name). `fused`
    runs known layer layouts through workers/engine/fused.py instead
    of the HF modules; `quant` (workers/engine/quant.py) quantizes the layers' linears as each loads, and a
    mixture's experts (workers/engine/quant_experts.py). A checkpoint saved quantized by transformers'
    bitsandbytes integration loads as it is stored (its experts as stored: full width)."""
    files: dict[str, Path] = {}
    if source is not None:
        (config, weights), stored = source, "none"
        full = config
    else:
        model_dir = resolve_model_dir(model)
        full = AutoConfig.from_pretrained(model_dir)
        config, files = text_config(full), weight_files(model_dir)  # a multimodal wrapper: its text model
        stored = prequantized_scheme(full) if files else "none"
    if stored != "none" and check_scheme(quant) not in ("none", stored):
        raise ModelLoadError(f"the checkpoint is stored as {stored}: it cannot be loaded as {quant}")
    refuse_windows(config)
    dtype = dtype or getattr(config, "dtype", None) or getattr(full, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    refuse_half(config, dtype)
    n_layers = config.num_hidden_layers
    a, b = layers if layers is not None else (0, n_layers)
    if not 0 <= a < b <= n_layers:
        raise ModelLoadError(f"layers {a}:{b} outside the model's 0:{n_layers}")
    refuse_split(config, (a, b))  # Gemma 4: a KV-shared layer runs beside its source (workers/engine/per_layer.py)
    if stored != "none":  # the skeleton is a plain model; its linears get the stored codes below
        config = type(config).from_dict({k: v for k, v in config.to_dict().items() if k != "quantization_config"})
    with parameters_on_meta():
        skeleton = AutoModelForCausalLM.from_config(config, attn_implementation=attention.NAME)
    aliases = stored_aliases(skeleton, set(files)) if files else {}  # a wrapper's decoder stored under its prefix

    def read(names: dict[str, str], dt: torch.dtype, dev: str) -> dict[str, torch.Tensor]:
        return read_tensors(files, {k: aliases.get(n, n) for k, n in names.items()}, dt, dev)

    def stored_source(names: dict[str, str], shapes: dict[str, tuple], dt: torch.dtype, dev: str) -> dict:
        return read(names, dt, dev)

    def raw(names: list[str]) -> dict[str, torch.Tensor]:
        got = read_raw(files, [aliases.get(n, n) for n in names])
        return {n: got[aliases.get(n, n)] for n in names}

    keys = set(aliases) or set(files)  # the checkpoint's tensors by the text model's names
    if files:
        weights = stored_source
    if files and (plan := converted_names(skeleton, sorted(keys))):  # experts stored one by one, say
        weights = converting_source(keys, plan, read)
    base = skeleton.get_decoder()
    refuse_layout(skeleton)
    kept = nn.ModuleList(base.layers[a:b])
    refuse_layers(config, kept, a)
    fuse = fused and can_fuse(kept, config) and not takes_layer_inputs(config)
    parts, scheme = [], stored if stored != "none" else check_scheme(quant)
    for layer in kept:
        prefix = prefix_of(skeleton, layer)
        if stored != "none":
            prequantized_layer(layer, prefix, stored, keys, raw, device, dtype)
            materialise_rest(layer, prefix, weights, dtype, device)
        else:
            materialise(layer, prefix, weights, dtype, device)
            if scheme != "none":  # as each layer loads: peak memory stays one full-width layer above
                quantize_layer(layer, scheme, dtype)
                quantize_experts(layer, scheme)  # a mixture's 3-D expert weights (workers/engine/quant_experts.py)
        if fuse:  # concatenate as each layer loads: peak memory stays one layer above the shard's
            parts.append(fuse_layer(layer, torch.device(device).type != "cpu" and scheme == "none", config))
    embed_mod = norm_mod = head_mod = None
    embed_name = f"{prefix_of(skeleton, base.embed_tokens)}weight"
    if embed:
        embed_mod = base.embed_tokens
        materialise(embed_mod, "", weights, dtype, device, {"weight": embed_name})
    if head:
        norm_mod, head_mod = base.norm, skeleton.get_output_embeddings()
        materialise(norm_mod, prefix_of(skeleton, norm_mod), weights, dtype, device)
        tied = bool(getattr(full, "tie_word_embeddings", False))  # a wrapper's own says (its text config may not)
        if tied and embed_mod is not None:
            head_mod.weight = embed_mod.weight
        else:
            src = embed_name if tied else f"{prefix_of(skeleton, head_mod)}weight"
            materialise(head_mod, "", weights, dtype, device, {"weight": src})
    rotary = type(base.rotary_emb)(config=config).to(device)
    shard = Shard(config, (a, b), kept, rotary, embed_mod, norm_mod, head_mod).eval()
    if takes_layer_inputs(config):  # its ids' per-layer inputs, its own slices of their weights (per_layer.py)
        tied_head = head_mod if head and bool(getattr(full, "tie_word_embeddings", False)) else None
        shard.layer_inputs = load_layer_inputs(
            skeleton, config, (a, b), tokens=embed_mod, tied_head=tied_head, files=files, aliases=aliases,
            weights=weights, dtype=dtype, device=device,
        )  # fmt: skip
    for mod in shard.modules():  # the buffers the skeleton computed, on the shard's device
        for name, buf in list(mod._buffers.items()):
            if buf is not None and not buf.is_meta and buf.device != torch.device(device):
                mod._buffers[name] = buf.to(device)
    shard.quant, shard._dtype = scheme, dtype
    left = [n for n, p in shard.named_parameters() if p.is_meta] + [n for n, t in shard.named_buffers() if t.is_meta]
    if left:
        raise ModelLoadError(f"tensors left unloaded: {left[:4]}")
    pool_backed(kept)  # linear-attention layers read and write a static pool's states where their cache has one
    if fuse:
        shard.fused = fused_stack(kept[0], parts, config)
        if shard.windowed:  # the in-place kernel takes no windows: masks over gathered keys and values
            shard.fused.kernel = None
    return shard
