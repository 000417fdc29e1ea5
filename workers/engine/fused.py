"""A leaner forward for Llama/Qwen2/Mistral/Ministral-style decoder layers, Qwen3's (the same with q and k normed
per head before the rotary: one weightless RMSNorm over q and k together, times their weights stacked per head) and
Gemma 3's (norms scaling by 1 + w, four a layer: the attention's and the MLP's outputs normed before their residual
adds; tanh GELU; a rotary per layer type, local and global), and the mixtures of experts on those attentions
(Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral, gpt-oss with its attention sinks and half-width rotary: the
experts' block is called as it is, transformers' grouped-GEMM experts, graph-safe): the same weights and computation
as the Hugging Face layers, in about half the kernel launches (a 14-layer 7B shard: 800 -> 386 on an H200). Kernels:
fused_ops.py.

Equal in float32 to ~1e-6 (tests/test_fused.py, bench/batch_check.py, removed: git history before 92894f6); in bf16
some roundings fall elsewhere (the norm's weight is applied before rounding, a residual add is fused into its GEMM,
rotary rounds once, SiLU's exp is Triton's), differences of the size of those between a round's K+1-row forwards
and `generate`'s one-row steps. Steps with gathered keys whose scores would outgrow `shard.FUSED_MAX_SCORE_BYTES`
(long prefills) run the HF layers.

A lone drafter step is latency-bound: on an H200 the stock layer launched ~48 kernels per layer (7 GEMMs, a dozen
elementwise ops for RMSNorm and rotary embeddings, K/V copies per query head), ~2 µs each. Here each layer runs:
- one RMSNorm kernel (`F.rms_norm`) before attention and one before the MLP;
- one GEMM for q, k and v together (weights concatenated at load; the HF modules keep views of them, so no memory is
  duplicated) and one for gate and up, then SiLU(gate) * up as one Triton kernel on CUDA (`decode_triton.silu_mul`);
- rotary embeddings for q and k as one batched matmul by a per-position rotation matrix built once per forward
  (exactly `x * cos + rotate_half(x) * sin`); under torch.compile the elementwise form, which inductor fuses;
- attention over a batch's pool in place (pool_attention.py, FlashAttention) where it runs; else as GEMMs with the
  grouped-query heads folded into the query rows and the mask as an additive bias built once per forward, or, on CUDA
  in half precision for round-sized steps (`SDPA_MAX_TOKENS`) of at least `SDPA_MIN_ROWS` query rows, torch's SDPA
  over the same layout (a 7B round at 64 sequences 61 against 134 us a layer on an H200, bench/attn_variants.py,
  removed: git history before 92894f6);
- the output and down projections fused with their residual adds (`addmm`).
A drafter's steps of a few token rows over a pool read in place run as Triton kernels instead (decode_kernels.py).
Caches are the same objects (`update(k, v, layer_idx)`), so dynamic, static and batched caches work. `can_fuse(layers,
config)` says whether a layout is known (otherwise the HF layers run); `fuse_layer` concatenates a loaded layer's
weights as it loads, so peak memory stays one layer up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.nn import functional as F

from workers.engine import pool_attention
from workers.engine.decode_kernels import DecodeLayers, merge_kernel, silu_mul_kernel
from workers.engine.fused_ops import (
    attend,
    attend_sdpa,
    full_width,
    rotate_elementwise,
    rotate_half_signs,
    rotation,
    score_dtype,
    wide_gemm_works,
)

KNOWN = set(  # the layer classes this module runs
    "Qwen2DecoderLayer LlamaDecoderLayer MistralDecoderLayer MinistralDecoderLayer Qwen3DecoderLayer"
    " Gemma3DecoderLayer Qwen3MoeDecoderLayer Qwen2MoeDecoderLayer MixtralDecoderLayer GptOssDecoderLayer".split()
)
ACTS = {"silu": F.silu, "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh")}
SDPA_MIN_ROWS = 512  # query rows (batch x tokens x query heads) from which CUDA half batches attend through SDPA
# ... for steps of up to this many tokens a row (rounds, drafts: the shapes graphs capture). cuDNN builds a plan per
# new shape, and prompts' eager batches come in many (on an H200 that added about a second to the first tokens of
# 256 jobs, run 50 of docs/runs/journal.md)
SDPA_MAX_TOKENS = 16
# (weight, bias), or a quantized linear module (workers/engine/quant.py), called as it is
Linear = tuple[torch.Tensor, torch.Tensor | None] | nn.Module
CosSin = tuple[torch.Tensor, torch.Tensor]


@dataclass
class FusedLayer:
    idx: int
    ln1: torch.Tensor
    eps1: float
    qkv: list[Linear]  # one concatenated (weight, bias), or q, k, v apart
    w_o: torch.Tensor | nn.Module
    b_o: torch.Tensor | None
    ln2: torch.Tensor
    eps2: float
    gate_up: list[Linear]  # one concatenated (weight, None), or gate and up apart (none for a mixture of experts)
    w_down: torch.Tensor | nn.Module | None
    qk_norm: torch.Tensor | None = None  # Qwen3's per-head q_norm / k_norm weights, [q heads + kv heads, head dim]
    eps_qk: float = 0.0
    post_attn: torch.Tensor | None = None  # Gemma 3's norms of the attention's and the MLP's outputs
    post_mlp: torch.Tensor | None = None
    act: str = "silu"
    moe: nn.Module | None = None  # a mixture of experts' block, called as it is (router, experts, shared expert)
    sinks: torch.Tensor | None = None  # gpt-oss's attention sinks, a logit per query head


def _fuse(mods: list[nn.Linear]) -> Linear:
    """Concatenate Linear weights (and biases: all or none, see `_supported`); the modules get views of them."""
    w = torch.cat([m.weight.detach() for m in mods])
    b = torch.cat([m.bias.detach() for m in mods]) if mods[0].bias is not None else None
    at = 0
    for m in mods:
        n, at = m.weight.shape[0], at + m.weight.shape[0]
        m.weight = nn.Parameter(w[at - n : at], requires_grad=False)
        if b is not None:
            m.bias = nn.Parameter(b[at - n : at], requires_grad=False)
    return w, b


def _supported(layer: nn.Module, config: object) -> bool:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if type(layer).__name__ not in KNOWN or attn is None or mlp is None:
        return False
    if hasattr(attn, "q_norm") and not _head_norms(attn):
        return False  # a norm over the whole projection (OLMo 2's), not one per head
    if len({m.bias is None for m in (attn.q_proj, attn.k_proj, attn.v_proj)}) > 1:
        return False
    if getattr(config, "attn_logit_softcapping", None) or getattr(config, "use_bidirectional_attention", False):
        return False
    if _experts(mlp):
        return True
    if _act(config) not in ACTS or getattr(mlp, "down_proj", None) is None:
        return False
    gated = all(getattr(mlp, n, None) is not None for n in ("gate_proj", "up_proj"))
    return gated and not getattr(config, "mlp_bias", False)


def _experts(mlp: nn.Module) -> bool:
    """Whether an MLP is a mixture of experts' block (3-D expert tensors, a router): called as it is, graph-safe
    through transformers' grouped-GEMM experts (tokens sorted by expert, offsets on the device)."""
    return hasattr(mlp, "experts") and (hasattr(mlp, "gate") or hasattr(mlp, "router"))


class FusedLayers:
    """Runs a stack of decoder layers with fused weights; see the module docstring."""

    def __init__(self, layers: list[FusedLayer], heads: int, kv_heads: int, head_dim: int, scale: float) -> None:
        self.layers, self.heads, self.kv_heads, self.head_dim, self.scale = layers, heads, kv_heads, head_dim, scale
        w = layers[0].ln1  # the compute dtype and device (quantized weights are stored otherwise)
        self.wide_gemm = w.is_cuda and w.dtype != torch.float32 and wide_gemm_works(w.device, w.dtype)
        self.signs = rotate_half_signs(head_dim, w.dtype, w.device)  # made here: nothing is built in a capture
        sd = score_dtype(w)
        self.mask_values = (
            torch.zeros((), dtype=sd, device=w.device),
            torch.full((), -torch.inf, dtype=sd, device=w.device),
        )
        self.sinks = any(p.sinks is not None for p in layers)  # softmax with a sink column: `attend` only
        self.sdpa = w.is_cuda and w.dtype in (torch.float16, torch.bfloat16)
        self.mask_half = tuple(v.to(w.dtype) for v in self.mask_values)
        # attention over a batch's pool in place where FlashAttention runs (workers/engine/pool_attention.py);
        # the engine may turn it off, or on with the reference kernel (EngineSettings.attention)
        self.kernel: pool_attention.Kernel | None = (
            pool_attention.flash if pool_attention.supported(w.device, w.dtype, head_dim) and not self.sinks else None
        )
        self.decode: DecodeLayers | None = None  # steps of a few token rows as Triton kernels (drafters: `Shard`)
        inter = next((_width(p.gate_up) // 2 for p in layers if p.gate_up and p.act == "silu"), 0)  # none: no kernel
        self.silu_mul = silu_mul_kernel(w.device, w.dtype, inter)  # SiLU(gate) * up as one kernel, where it runs
        self.merge = merge_kernel(w.device, w.dtype, head_dim) if self.kernel is not None else None  # rounds' merge

    def attends_in_place(self, cache: object) -> bool:
        """Whether a forward over `cache` reads its pool in place (no gathered copy, no mask, any length)."""
        return self.kernel is not None and hasattr(cache, "in_place")

    def __call__(
        self, h: torch.Tensor, cos_sin: CosSin | list[CosSin], masks: list[torch.Tensor | None], cache: object
    ) -> torch.Tensor:
        """h [B, T, hidden], cos/sin [B, T, d] (the HF rotary module's; or one per layer, Gemma 3's local and global
        bases: layers of one type share one object), each layer's mask bool [B|1, 1, T, L] or None (layers with one
        window share one mask object, so one bias)."""
        b, t, _ = h.shape
        if self.decode is not None and self.attends_in_place(cache) and not isinstance(cos_sin, list):
            pool, rows, last, reach = cache.in_place()  # type: ignore[attr-defined]
            if self.decode.applies(pool, b, t, reach, cos_sin[0]):
                return self.decode(h, *cos_sin, pool, rows, last, reach)
        per_layer = cos_sin if isinstance(cos_sin, list) else [cos_sin] * len(self.layers)
        # one rotary per distinct cos/sin, not per layer: a 7B round's rotation matrices at 128 sequences are 38 MB
        made = {i: self._rope(full_width(cs, self.head_dim)) for i, cs in {id(cs): cs for cs in per_layer}.items()}
        ropes = [made[id(cs)] for cs in per_layer]
        g = self.heads // self.kv_heads
        if self.attends_in_place(cache):
            pool, rows, last, reach = cache.in_place()  # type: ignore[attr-defined]
            lay = pool_attention.layout(rows, last, t, self.kv_heads, g, pool.index.shape[0], reach, pool.padding)
            in_place = partial(pool_attention.attend, lay=lay, scale=self.scale, kernel=self.kernel, merge=self.merge)
            for layer, rope in zip(self.layers, ropes, strict=True):
                h = self._layer(layer, h, rope, partial(_in_place, cache, in_place))
            return h
        attention = partial(attend, scale=self.scale, wide_gemm=self.wide_gemm)
        sdpa = self.sdpa and not self.sinks and t <= SDPA_MAX_TOKENS and b * t * self.heads >= SDPA_MIN_ROWS
        sdpa = sdpa and not torch.compiler.is_compiling()
        if sdpa:
            attention = partial(attend_sdpa, scale=self.scale)
        biases: dict[int, torch.Tensor | None] = {}
        for layer, mask, rope in zip(self.layers, masks, ropes, strict=True):
            if id(mask) not in biases:
                biases[id(mask)] = self._bias(mask, b, t, g, sdpa)
            attend_layer = attention if layer.sinks is None else partial(attention, sinks=layer.sinks)
            h = self._layer(layer, h, rope, partial(_gathered, cache, attend_layer, biases[id(mask)]))
        return h

    def _rope(self, cos_sin: CosSin) -> Callable[[torch.Tensor], torch.Tensor]:
        if torch.compiler.is_compiling():  # inductor fuses the elementwise form into neighbouring kernels
            cos, sin = (c.reshape(-1, 1, c.shape[-1]) for c in cos_sin)
            return partial(rotate_elementwise, cos=cos, sin=sin)
        return partial(torch.matmul, other=rotation(*cos_sin, self.signs))  # eager: one batched matmul

    def _bias(self, mask: torch.Tensor | None, b: int, t: int, g: int, sdpa: bool) -> torch.Tensor | None:
        """A mask as the additive bias its attention takes: [B, 1, g * T, L] in the compute dtype for SDPA (broadcast
        over key/value heads), else [B * kv_heads, g * T, L] in the score dtype."""
        if mask is None:
            return None
        n = mask.shape[-1]
        if sdpa:
            full = torch.where(mask, *self.mask_half)
            return full[:, :, None].expand(b, 1, g, t, n).reshape(b, 1, g * t, n)
        full = torch.where(mask, *self.mask_values)  # [B|1, 1, T, L] additive bias
        return full[:, :, None].expand(b, self.kv_heads, g, t, n).reshape(-1, g * t, n)

    def _layer(
        self, p: FusedLayer, h: torch.Tensor, rope: Callable[[torch.Tensor], torch.Tensor], attn: Attention
    ) -> torch.Tensor:
        b, t, width = h.shape
        hq, hkv, d = self.heads, self.kv_heads, self.head_dim
        x = F.rms_norm(h, (width,), p.ln1, p.eps1)
        qkv = _linear_cat(x, p.qkv).view(b * t, hq + 2 * hkv, d)
        qk = qkv[:, : hq + hkv]
        if p.qk_norm is not None:  # each head's q and k normed over its width (Qwen3), before the rotary
            qk = F.rms_norm(qk, (d,), None, p.eps_qk) * p.qk_norm
        qk = rope(qk).view(b, t, hq + hkv, d)  # rotary embeddings, q and k at once
        v = qkv[:, hq + hkv :].view(b, t, hkv, d).transpose(1, 2)
        o = attn(qk[:, :, :hq], qk[:, :, hq:].transpose(1, 2), v, p.idx)  # [B * T, hq * d]
        h2 = _out(h.view(b * t, width), o, p.w_o, p.b_o, p.post_attn, p.eps2)
        x = F.rms_norm(h2, (width,), p.ln2, p.eps2)
        if p.moe is not None:
            y = p.moe(x.view(b, t, width))
            return (h2 + (y[0] if isinstance(y, tuple) else y).reshape(b * t, width)).view(b, t, width)
        h2 = _out(h2, self._gated(_linear_cat(x, p.gate_up), p.act), p.w_down, None, p.post_mlp, p.eps2)  # type: ignore[arg-type]
        return h2.view(b, t, width)

    def _gated(self, gu: torch.Tensor, act: str) -> torch.Tensor:
        """act(gate) * up of rows gu = [gate, up]: SiLU's as one Triton kernel where it runs (not inside
        torch.compile, whose inductor fuses the two itself), else torch's."""
        if self.silu_mul is not None and act == "silu" and gu.is_contiguous() and not torch.compiler.is_compiling():
            return self.silu_mul(gu.view(-1, gu.shape[-1]))
        gate, up = gu.chunk(2, dim=-1)
        return ACTS[act](gate) * up


# (queries [B, T, hq, d], this step's keys and values [B, hkv, T, d], layer index) -> attention output [B * T, hq * d]
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def _gathered(
    cache: object,
    attention: Callable[..., torch.Tensor],
    bias: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    idx: int,
) -> torch.Tensor:
    """Write the step's keys/values, attend over what the cache returns (a slot, a gathered batch, a copy)."""
    keys, values = cache.update(k, v, idx)  # type: ignore[attr-defined]
    return attention(q, keys, values, bias)


def _in_place(
    cache: object, attention: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: int
) -> torch.Tensor:
    """Write the step's keys/values into the pool and attend over it where it is."""
    keys, values = cache.write(k, v, idx)  # type: ignore[attr-defined]
    return attention(q, keys, values, new=(k, v))


def _linear(x: torch.Tensor, p: Linear) -> torch.Tensor:
    # bitsandbytes' CPU 4-bit kernel reads its input as contiguous (a strided one gives wrong numbers)
    return F.linear(x, *p) if isinstance(p, tuple) else p(x.contiguous())


def _width(parts: list[Linear]) -> int:  # output features of these linears together
    return sum(p[0].shape[0] if isinstance(p, tuple) else int(getattr(p, "out_features", 0)) for p in parts)


def _linear_cat(x: torch.Tensor, parts: list[Linear]) -> torch.Tensor:
    if len(parts) == 1:
        return _linear(x, parts[0])
    return torch.cat([_linear(x, p) for p in parts], dim=-1)


def _residual(h: torch.Tensor, x: torch.Tensor, w: torch.Tensor | nn.Module, b: torch.Tensor | None) -> torch.Tensor:
    """h + x @ w.T (+ b): one addmm for a plain weight without bias."""
    if not isinstance(w, torch.Tensor):
        return h + w(x.contiguous())
    return torch.addmm(h, x, w.t()) if b is None else h + F.linear(x, w, b)


def _out(
    h: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor | nn.Module,
    b: torch.Tensor | None,
    norm: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """A block's output added to the residual stream: h + x @ w.T (+ b), or with Gemma 3's norm of it between."""
    if norm is None:
        return _residual(h, x, w, b)
    y = w(x.contiguous()) if not isinstance(w, torch.Tensor) else F.linear(x, w, b)
    return h + F.rms_norm(y, (y.shape[-1],), norm, eps)


def _act(config: object) -> str:
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")


def _norm(norm: nn.Module) -> tuple[torch.Tensor, float]:
    """An RMSNorm's weight as it scales (Gemma's scale by 1 + w) and its epsilon."""
    w = norm.weight.detach()
    eps = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", 1e-6)
    return (1.0 + w if type(norm).__name__.startswith("Gemma") else w), float(eps)


def can_fuse(layers: nn.ModuleList, config: object) -> bool:
    """Whether every layer has a layout this module runs (checkable on the meta device, before loading)."""
    if len(layers) == 0 or not all(_supported(layer, config) for layer in layers):
        return False
    heads, kv_heads, head_dim = _heads(layers[0], config)
    attn = layers[0].self_attn
    return attn.q_proj.weight.shape[0] == heads * head_dim and attn.k_proj.weight.shape[0] == kv_heads * head_dim


def _heads(layer: nn.Module, config: object) -> tuple[int, int, int]:
    heads = config.num_attention_heads  # type: ignore[attr-defined]
    return heads, getattr(config, "num_key_value_heads", None) or heads, layer.self_attn.head_dim


def _head_norms(attn: nn.Module) -> bool:
    """Whether the attention norms q and k per head (`q_norm` / `k_norm` as wide as a head: Qwen3's)."""
    q, k, d = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None), getattr(attn, "head_dim", None)
    return all(n is not None and tuple(getattr(n, "weight", torch.empty(0)).shape) == (d,) for n in (q, k))


def _apart(mods: list[nn.Linear]) -> list[Linear]:
    return [(m.weight.detach(), m.bias.detach() if m.bias is not None else None) for m in mods]


def fuse_layer(layer: nn.Module, concat: bool, config: object) -> FusedLayer:
    """One loaded layer's weights; with `concat`, q/k/v and gate/up concatenated (its HF modules then hold
    views of them). CPU workers keep them apart: their weights are views of the memory-mapped checkpoint,
    and launches are cheap there. A quantized layer's linears are called as the modules they are."""
    attn, mlp = layer.self_attn, layer.mlp
    moe = mlp if _experts(mlp) else None
    qkv_mods, gu_mods = [attn.q_proj, attn.k_proj, attn.v_proj], [] if moe else [mlp.gate_proj, mlp.up_proj]
    w_o: torch.Tensor | nn.Module = attn.o_proj
    w_down: torch.Tensor | nn.Module | None = None if moe else mlp.down_proj
    b_o = None
    if type(attn.q_proj) is not nn.Linear:  # quantized (workers/engine/quant.py)
        qkv, gate_up = list[Linear](qkv_mods), list[Linear](gu_mods)
    else:
        if concat:
            qkv, gate_up = [_fuse(qkv_mods)], [_fuse(gu_mods)] if gu_mods else []
        else:
            qkv, gate_up = _apart(qkv_mods), _apart(gu_mods)
        w_o = attn.o_proj.weight.detach()
        w_down = None if moe else mlp.down_proj.weight.detach()
        b_o = attn.o_proj.bias.detach() if attn.o_proj.bias is not None else None
    gemma = hasattr(layer, "pre_feedforward_layernorm")  # Gemma 3: four norms a layer
    (ln1, eps1), (ln2, eps2) = (
        _norm(layer.input_layernorm),
        _norm(layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm),
    )
    return FusedLayer(
        idx=attn.layer_idx,
        ln1=ln1,
        eps1=eps1,
        qkv=qkv,
        w_o=w_o,
        b_o=b_o,
        ln2=ln2,
        eps2=eps2,
        gate_up=gate_up,
        w_down=w_down,
        post_attn=_norm(layer.post_attention_layernorm)[0] if gemma else None,
        post_mlp=_norm(layer.post_feedforward_layernorm)[0] if gemma else None,
        act=_act(config),
        moe=moe,
        sinks=attn.sinks.detach().float() if hasattr(attn, "sinks") else None,  # in the scores' dtype, made once
        **_norms_of(layer, config),
    )


def _norms_of(layer: nn.Module, config: object) -> dict:
    if not hasattr(layer.self_attn, "q_norm"):
        return {}
    heads, kv_heads, _ = _heads(layer, config)
    (q, eps), (k, _) = _norm(layer.self_attn.q_norm), _norm(layer.self_attn.k_norm)
    return {"qk_norm": torch.cat([q.expand(heads, -1), k.expand(kv_heads, -1)]).contiguous(), "eps_qk": eps}


def fused_stack(first: nn.Module, parts: list[FusedLayer], config: object) -> FusedLayers:
    heads, kv_heads, head_dim = _heads(first, config)
    return FusedLayers(parts, heads, kv_heads, head_dim, float(first.self_attn.scaling))
