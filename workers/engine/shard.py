"""Load a slice of a Hugging Face causal LM's layers and run it.

`load_shard(model, (a, b), embed=..., head=...)` builds the model skeleton on the meta device and
materialises only layers [a, b) (plus the embedding and/or final norm + LM head when asked), reading
just those tensors from the safetensors files. Tied embeddings are handled: a tail's LM head is read
from the embedding tensor. Qwen2 and Llama families (and others laid out like them) are supported.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from schemas.errors import ModelLoadError
from workers.engine import attention
from workers.engine.fused import FusedLayers, can_fuse, fuse_layer, fused_stack
from workers.engine.kvcache import BatchView, KVCache, StaticKVCache

Cache = KVCache | StaticKVCache
# Steps whose float32 attention scores (batch x heads x tokens x cached positions) would take more than
# this run through the HF layers (long or many prompt prefills), whose attention kernel does not
# materialise them as the fused path's GEMM attention does. Rounds always fit: 16 sequences x 9 tokens
# of a 7B shard (28 heads) over 8,192 positions take 132 MB; one 7B prefill may be 1,170 tokens over
# 2,048 positions, 292 over 8,192.
FUSED_MAX_SCORE_BYTES = 256 << 20
Source = Callable[[dict[str, str], dict[str, tuple], torch.dtype, str], dict[str, torch.Tensor]]


def resolve_model_dir(model: str | Path) -> Path:
    """A local model directory, or a hub id downloaded (weights as safetensors) into the HF cache."""
    path = Path(model)
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(model), allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"]))
    except Exception as e:
        raise ModelLoadError(f"{model!r} is neither a local directory nor a reachable hub model: {e}") from None


def weight_files(model_dir: Path) -> dict[str, Path]:
    """Map each tensor name of a safetensors checkpoint (single or multi-file) to its file."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: model_dir / f for k, f in weight_map.items()}
    single = model_dir / "model.safetensors"
    if not single.exists():
        raise ModelLoadError(f"no safetensors weights in {model_dir}")
    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def _read_tensors(files: dict[str, Path], names: dict[str, str], dtype: torch.dtype, device: str) -> dict:
    """Read checkpoint tensors `names` (local name -> checkpoint name) and cast them."""
    missing = [c for c in names.values() if c not in files]
    if missing:
        raise ModelLoadError(f"checkpoint lacks tensors {missing[:4]}")
    out: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for local, ckpt in names.items():
        by_file.setdefault(files[ckpt], []).append((local, ckpt))
    for path, pairs in by_file.items():
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for local, ckpt in pairs:
                out[local] = f.get_tensor(ckpt).to(device=device, dtype=dtype)
    return out


def _materialise(
    module: nn.Module, prefix: str, source: Source, dtype: torch.dtype, device: str, alias: dict | None = None
) -> None:
    """Give `module`'s parameters/buffers the tensors saved under `prefix` (alias: local -> checkpoint name)."""
    state = dict(module.state_dict(keep_vars=True))
    names = {k: (alias or {}).get(k, f"{prefix}{k}") for k in state}
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    module.load_state_dict(source(names, shapes, dtype, device), assign=True, strict=True)


def checkpoint_source(files: dict[str, Path]) -> Source:
    return lambda names, shapes, dtype, device: _read_tensors(files, names, dtype, device)


def _prefix_of(root: nn.Module, target: nn.Module) -> str:
    for name, mod in root.named_modules():
        if mod is target:
            return f"{name}." if name else ""
    raise ModelLoadError("model layout not understood (module not found)")


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
        self.fused: FusedLayers | None = None  # the lean forward of workers/engine/fused.py, when set (load_shard)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def forward(self, x: torch.Tensor, start_pos: int, cache: Cache, logits_last: int = 0) -> torch.Tensor:
        """Run the shard over x (token ids [n] with an embedding, else hidden states [n, h]).

        Positions are start_pos..start_pos+n-1 and `cache` must hold exactly start_pos positions.
        Returns hidden states [n, h], or logits [logits_last, vocab] of the last rows when the shard
        has an LM head and logits_last > 0.
        """
        if cache.length != start_pos:
            raise ValueError(f"cache holds {cache.length} positions, round starts at {start_pos}")
        n = x.shape[0]
        out = self.run(x, cache.positions(start_pos, n, x.device), cache, logits_last)
        if isinstance(cache, StaticKVCache):
            cache.advance(start_pos + n)
        return out

    def run(self, x: torch.Tensor, pos: torch.Tensor, cache: Cache, logits_last: int = 0) -> torch.Tensor:
        """The forward itself, over device positions `pos`; no host syncs, so it can be graph-captured."""
        h = self.embed(x)[None] if self.embed is not None else x[None]
        h = self._layers(h, pos[None], cache.mask(pos), cache)[0]
        if self.lm_head is None or logits_last <= 0:
            return h
        return self.lm_head(self.norm(h[-logits_last:]))

    def run_batch(
        self, x: torch.Tensor, pos: torch.Tensor, view: BatchView, pick: torch.Tensor | None = None
    ) -> torch.Tensor:
        """B sequences at once: x is [B, T] token ids (or [B, T, h] hidden states), pos [B, T].

        Returns hidden states [B, T, h], or with `pick` ([B, P] row indices) and an LM head the
        logits [B, P, vocab] of those rows. No host syncs: graph-capturable."""
        h = self.embed(x) if self.embed is not None else x
        h = self._layers(h, pos, view.mask(pos), view)
        if pick is None or self.lm_head is None:
            return h
        rows = torch.arange(h.shape[0], device=h.device)[:, None]
        return self.lm_head(self.norm(h[rows, pick]))

    def _fused_fits(self, h: torch.Tensor, mask: torch.Tensor | None) -> bool:
        assert self.fused is not None
        positions = mask.shape[-1] if mask is not None else h.shape[1]
        return h.shape[0] * self.fused.heads * h.shape[1] * positions * 4 <= FUSED_MAX_SCORE_BYTES

    def _layers(self, h: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor | None, cache: object) -> torch.Tensor:
        cos_sin = self.rotary(h, pos)
        if self.fused is not None and self._fused_fits(h, mask):
            return self.fused(h, cos_sin, mask, cache)
        for layer in self.layers:
            h = layer(
                h,
                attention_mask=mask,
                position_embeddings=cos_sin,
                position_ids=pos,
                past_key_values=cache,
                use_cache=True,
            )
        return h


def blank_input(shard: Shard, b: int, t: int) -> torch.Tensor:
    """Zeros shaped as a batch of b rows x t tokens this shard takes: token ids, or hidden states without an
    embedding."""
    if shard.embed is not None:
        return torch.zeros(b, t, dtype=torch.long, device=shard.device)
    return torch.zeros(b, t, shard.config.hidden_size, dtype=shard.dtype, device=shard.device)


def sliding_window(config: PretrainedConfig) -> int | None:
    """The attention window a config turns on (Mistral's `sliding_window`, Qwen2's sliding layers), or None."""
    windowed = "sliding_attention" in (getattr(config, "layer_types", None) or [])
    return getattr(config, "sliding_window", None) if windowed or config.model_type == "mistral" else None


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
) -> Shard:
    """Load layers [a, b) (None = all) of `model`, plus its embedding and/or norm + LM head.

    `model` is a local directory or hub id; `source` (config, weights) replaces it with weights from
    elsewhere (a plugin's model scheme, workers/plugins.py; `model` is then only its name). `fused`
    runs known layer layouts through workers/engine/fused.py instead
    of the HF modules."""
    if source is not None:
        config, weights = source
    else:
        model_dir = resolve_model_dir(model)
        config = AutoConfig.from_pretrained(model_dir)
        weights = checkpoint_source(weight_files(model_dir))
    window = sliding_window(config)
    if window is not None and window < (getattr(config, "max_position_embeddings", None) or window + 1):
        raise ModelLoadError(f"sliding-window attention ({window} positions) is not supported")
    n_layers = config.num_hidden_layers
    a, b = layers if layers is not None else (0, n_layers)
    if not 0 <= a < b <= n_layers:
        raise ModelLoadError(f"layers {a}:{b} outside the model's 0:{n_layers}")
    dtype = dtype or getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, attn_implementation=attention.NAME)
    base = skeleton.get_decoder()
    if not all(hasattr(base, a_) for a_ in ("layers", "rotary_emb", "norm", "embed_tokens")):
        raise ModelLoadError(f"{type(skeleton).__name__} is not laid out like Qwen2/Llama")
    kept = nn.ModuleList(base.layers[a:b])
    fuse = fused and can_fuse(kept, config)
    parts = []
    for layer in kept:
        _materialise(layer, _prefix_of(skeleton, layer), weights, dtype, device)
        if fuse:  # concatenate as each layer loads: peak memory stays one layer above the shard's
            parts.append(fuse_layer(layer, concat=torch.device(device).type != "cpu"))
    embed_mod = norm_mod = head_mod = None
    embed_name = f"{_prefix_of(skeleton, base.embed_tokens)}weight"
    if embed:
        embed_mod = base.embed_tokens
        _materialise(embed_mod, "", weights, dtype, device, {"weight": embed_name})
    if head:
        norm_mod, head_mod = base.norm, skeleton.get_output_embeddings()
        _materialise(norm_mod, _prefix_of(skeleton, norm_mod), weights, dtype, device)
        tied = bool(getattr(config, "tie_word_embeddings", False))
        if tied and embed_mod is not None:
            head_mod.weight = embed_mod.weight
        else:
            src = embed_name if tied else f"{_prefix_of(skeleton, head_mod)}weight"
            _materialise(head_mod, "", weights, dtype, device, {"weight": src})
    rotary = type(base.rotary_emb)(config=config).to(device)
    shard = Shard(config, (a, b), kept, rotary, embed_mod, norm_mod, head_mod).eval()
    left = [n for n, p in shard.named_parameters() if p.is_meta] + [n for n, t in shard.named_buffers() if t.is_meta]
    if left:
        raise ModelLoadError(f"tensors left unloaded: {left[:4]}")
    if fuse:
        shard.fused = fused_stack(kept[0], parts, config)
    return shard
