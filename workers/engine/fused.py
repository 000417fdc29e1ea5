"""A leaner forward for Llama/Qwen2/Mistral-style decoder layers, and Qwen3's (the same with q and k normed per
head before the rotary: one weightless RMSNorm over q and k together, times their weights stacked per head): the
same weights and computation as the Hugging Face layers, in about half the kernel launches (a 14-layer 7B shard:
800 -> 386 on an H200).

Equal in float32 to ~1e-6 (tests/test_fused.py, bench/batch_check.py); in bf16 some roundings fall
elsewhere (the norm's weight is applied before rounding, a residual add is fused into its GEMM,
rotary rounds once), differences of the same size as those between the K+1-row forwards of a round
and `generate`'s one-row steps. Steps whose scores would outgrow `shard.FUSED_MAX_SCORE_BYTES` (long
prefills) run the HF layers.

A lone drafter step is latency-bound: on an H200 the stock layer launched ~48 kernels per layer (7
GEMMs, a dozen elementwise ops for RMSNorm and rotary embeddings, K/V copies per query head), ~2 µs
each. Here each layer runs:
- one RMSNorm kernel (`F.rms_norm`) before attention and one before the MLP;
- one GEMM for q, k and v together (weights concatenated at load; the HF modules keep views of them,
  so no memory is duplicated) and one for gate and up;
- rotary embeddings for q and k as one batched matmul by a per-position rotation matrix built once
  per forward (exactly `x * cos + rotate_half(x) * sin`: two nonzero terms per output); under
  torch.compile the elementwise form, which inductor fuses into the kernels around it;
- attention as GEMMs with grouped-query heads folded into the query rows (no per-head K/V copies) and
  the causal/cache mask as an additive bias built once per forward (`baddbmm`, softmax, `bmm`);
- the output and down projections fused with their residual adds (`addmm`).
On CUDA in half precision, round-sized steps (`SDPA_MAX_TOKENS`) of at least `SDPA_MIN_ROWS` query rows (batch x
tokens x query heads) attend
through torch's `scaled_dot_product_attention` instead (the same folded layout and additive bias, one fused
kernel with float32 softmax; on an H200, bench/attn_variants.py: a 7B round's attention at 64 sequences 61 us a
layer against 134 us, a 0.5B drafter step at 64 sequences 14.0 against 17.7 us; at one sequence the GEMMs win).
Caches are the same objects (`update(k, v, layer_idx)`), so dynamic, static and batched caches work.
`can_fuse(layers, config)` says whether a layout is known (otherwise the HF layers run); `fuse_layer`
concatenates a loaded layer's weights, layer by layer as they load, so peak memory stays one layer up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.nn import functional as F

from workers.engine import pool_attention

KNOWN = {"Qwen2DecoderLayer", "LlamaDecoderLayer", "MistralDecoderLayer", "MinistralDecoderLayer", "Qwen3DecoderLayer"}
SDPA_MIN_ROWS = 512  # query rows (batch x tokens x query heads) from which CUDA half batches attend through SDPA
# ... for steps of up to this many tokens a row (rounds, drafts: the shapes graphs capture). cuDNN builds a plan per
# new shape, and prompts' eager batches come in many (on an H200 that added about a second to the first tokens of
# 256 jobs, run 50 of docs/benchmarks.md)
SDPA_MAX_TOKENS = 16
# (weight, bias), or a quantized linear module (workers/engine/quant.py), called as it is
Linear = tuple[torch.Tensor, torch.Tensor | None] | nn.Module


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
    gate_up: list[Linear]  # one concatenated (weight, None), or gate and up apart
    w_down: torch.Tensor | nn.Module
    qk_norm: torch.Tensor | None = None  # Qwen3's per-head q_norm / k_norm weights, [q heads + kv heads, head dim]
    eps_qk: float = 0.0


def _fuse(mods: list[nn.Linear]) -> Linear:
    """Concatenate Linear weights (and biases: all or none, see `_supported`) along the output dim; the
    modules get views of them."""
    w = torch.cat([m.weight.detach() for m in mods])
    b = torch.cat([m.bias.detach() for m in mods]) if mods[0].bias is not None else None
    at = 0
    for m in mods:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(w[at : at + n], requires_grad=False)
        if b is not None:
            m.bias = nn.Parameter(b[at : at + n], requires_grad=False)
        at += n
    return w, b


def _supported(layer: nn.Module, config: object) -> bool:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if type(layer).__name__ not in KNOWN or attn is None or mlp is None:
        return False
    if hasattr(attn, "q_norm") and not _head_norms(attn):
        return False  # a norm over the whole projection (OLMo 2's), not one per head
    if len({m.bias is None for m in (attn.q_proj, attn.k_proj, attn.v_proj)}) > 1:
        return False
    if getattr(config, "hidden_act", "silu") != "silu" or getattr(mlp, "down_proj", None) is None:
        return False
    return all(getattr(mlp, n, None) is not None for n in ("gate_proj", "up_proj")) and not getattr(
        config, "mlp_bias", False
    )


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
        self.sdpa = w.is_cuda and w.dtype in (torch.float16, torch.bfloat16)
        self.mask_half = tuple(v.to(w.dtype) for v in self.mask_values)
        # attention over a batch's pool in place where FlashAttention runs (workers/engine/pool_attention.py);
        # the engine may turn it off, or on with the reference kernel (EngineSettings.attention)
        self.kernel: pool_attention.Kernel | None = (
            pool_attention.flash if pool_attention.supported(w.device, w.dtype, head_dim) else None
        )

    def attends_in_place(self, cache: object) -> bool:
        """Whether a forward over `cache` reads its pool in place (no gathered copy, no mask, any length)."""
        return self.kernel is not None and hasattr(cache, "in_place")

    def __call__(
        self,
        h: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        masks: list[torch.Tensor | None],
        cache: object,
    ) -> torch.Tensor:
        """h [B, T, hidden], cos/sin [B, T, d] (the HF rotary module's), each layer's mask bool [B|1, 1, T, L] or
        None (layers with one window share one mask object, so one bias)."""
        b, t, _ = h.shape
        if torch.compiler.is_compiling():  # inductor fuses the elementwise form into neighbouring kernels
            cos, sin = (c.reshape(-1, 1, c.shape[-1]) for c in cos_sin)
            rope: Callable[[torch.Tensor], torch.Tensor] = partial(rotate_elementwise, cos=cos, sin=sin)
        else:  # eager: one batched matmul is fewer launches than the five elementwise ops
            rope = partial(torch.matmul, other=rotation(*cos_sin, self.signs))
        g = self.heads // self.kv_heads
        if self.attends_in_place(cache):
            pool, rows, last = cache.in_place()  # type: ignore[attr-defined]
            lay = pool_attention.layout(rows, last, t, self.kv_heads, g, pool.index.shape[0])
            in_place = partial(pool_attention.attend, lay=lay, scale=self.scale, kernel=self.kernel)
            for layer in self.layers:
                h = self._layer(layer, h, rope, partial(_in_place, cache, in_place))
            return h
        attention = partial(attend, scale=self.scale, wide_gemm=self.wide_gemm)
        sdpa = self.sdpa and t <= SDPA_MAX_TOKENS and b * t * self.heads >= SDPA_MIN_ROWS
        sdpa = sdpa and not torch.compiler.is_compiling()
        if sdpa:
            attention = partial(attend_sdpa, scale=self.scale)
        biases: dict[int, torch.Tensor | None] = {}
        for layer, mask in zip(self.layers, masks, strict=True):
            if id(mask) not in biases:
                biases[id(mask)] = self._bias(mask, b, t, g, sdpa)
            h = self._layer(layer, h, rope, partial(_gathered, cache, attention, biases[id(mask)]))
        return h

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
        h2 = _residual(h.view(b * t, width), o, p.w_o, p.b_o)
        x = F.rms_norm(h2, (width,), p.ln2, p.eps2)
        gate, up = _linear_cat(x, p.gate_up).chunk(2, dim=-1)
        h2 = _residual(h2, F.silu(gate) * up, p.w_down, None)
        return h2.view(b, t, width)


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


def _linear_cat(x: torch.Tensor, parts: list[Linear]) -> torch.Tensor:
    if len(parts) == 1:
        return _linear(x, parts[0])
    return torch.cat([_linear(x, p) for p in parts], dim=-1)


def _residual(h: torch.Tensor, x: torch.Tensor, w: torch.Tensor | nn.Module, b: torch.Tensor | None) -> torch.Tensor:
    """h + x @ w.T (+ b): one addmm for a plain weight without bias."""
    if not isinstance(w, torch.Tensor):
        return h + w(x.contiguous())
    return torch.addmm(h, x, w.t()) if b is None else h + F.linear(x, w, b)


def rotate_half_signs(d: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """S [d, d] with x @ S = rotate_half(x): out_i (i < d/2) is -x_{i+d/2}, out_{i+d/2} is x_i."""
    half = d // 2
    sign = torch.zeros(d, d, dtype=dtype)
    i = torch.arange(half)
    sign[i + half, i] = -1.0
    sign[i, i + half] = 1.0
    return sign.to(device)


def rotate_elementwise(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, as the HF layers write it (x [N, heads, d], cos/sin [N, 1, d])."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def rotation(cos: torch.Tensor, sin: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """Per-position matrices R [B*T, d, d] with x @ R = x * cos + rotate_half(x) * sin (signs: see above)."""
    d = cos.shape[-1]
    cos, sin = cos.reshape(-1, d), sin.reshape(-1, d)
    return torch.diag_embed(cos) + signs * sin[:, None, :]


def score_dtype(x: torch.Tensor) -> torch.dtype:
    """Attention scores are kept in (at least) float32, as flash kernels keep them."""
    return torch.promote_types(x.dtype, torch.float32)


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    wide_gemm: bool = False,
) -> torch.Tensor:
    """q [B, T, hq, d] against keys/values [B, hkv, L, d]; returns [B * T, hq * d].

    Query head h = i * g + j uses key/value head i, so queries are regrouped as [B * hkv, g * T, d]
    and multiply the caches as they are."""
    b, t, hq, d = q.shape
    hkv, length = keys.shape[1], keys.shape[2]
    g = hq // hkv
    q3 = q.reshape(b, t, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b * hkv, g * t, d)
    k3 = keys.reshape(b * hkv, length, d).transpose(1, 2)
    wide = score_dtype(q)
    if bias is None:
        bias = torch.zeros((), dtype=wide, device=q.device).expand(b * hkv, g * t, length)
    if wide != q.dtype:  # bf16/fp16 on CUDA: float32 scores from the half GEMM, probabilities back in half
        probs = torch.softmax(_wide_scores(bias, q3, k3, scale, wide_gemm), dim=-1).to(q.dtype)
    else:
        probs = torch.softmax(torch.baddbmm(bias, q3, k3, alpha=scale), dim=-1)
    out = torch.bmm(probs, values.reshape(b * hkv, length, d))
    return out.view(b, hkv, g, t, d).permute(0, 3, 1, 2, 4).reshape(b * t, hq * d)


def attend_sdpa(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """`attend` through torch's scaled_dot_product_attention: q [B, T, hq, d] folded to [B, hkv, g * T, d]
    against keys/values [B, hkv, L, d], bias [B, 1, g * T, L] (or None); returns [B * T, hq * d]."""
    b, t, hq, d = q.shape
    hkv = keys.shape[1]
    g = hq // hkv
    q4 = q.reshape(b, t, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * t, d)
    out = F.scaled_dot_product_attention(q4, keys, values, attn_mask=bias, scale=scale)
    return out.view(b, hkv, g, t, d).permute(0, 3, 1, 2, 4).reshape(b * t, hq * d)


def wide_gemm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch has half x half -> float32 `baddbmm(..., out_dtype=)` on `device` for the bias
    layouts `attend` passes (broadcast views); probed once, at load."""
    a = torch.ones(2, 3, 4, dtype=dtype, device=device)
    b = torch.ones(2, 4, 5, dtype=dtype, device=device)
    biases = (torch.zeros((), device=device).expand(2, 3, 5), torch.zeros(1, 3, 5, device=device).expand(2, 3, 5))
    try:
        outs = [torch.baddbmm(c, a, b, alpha=0.5, out_dtype=torch.float32) for c in biases]
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return all(o.dtype == torch.float32 and bool((o == 2.0).all()) for o in outs)


def _wide_scores(bias: torch.Tensor, q3: torch.Tensor, k3: torch.Tensor, scale: float, one_gemm: bool) -> torch.Tensor:
    """bias + scale * q3 @ k3 in float32 from half inputs: one GEMM where torch has `out_dtype` (CUDA),
    else a float32 GEMM of widened copies (CPU). Under torch.compile (which cannot trace `out_dtype`;
    only drafters are compiled) a half GEMM, widened after its float32 accumulation is rounded: inductor
    fuses the widening into the softmax, where a float32 GEMM is a slow SIMT kernel on an H200 (0.8 ms
    of a K = 8 draft, run 12). The rounding can only change which drafts are proposed, never the output."""
    if torch.compiler.is_compiling():
        return torch.bmm(q3, k3).float() * scale + bias
    if one_gemm:
        return torch.baddbmm(bias, q3, k3, alpha=scale, out_dtype=torch.float32)
    return torch.baddbmm(bias, q3.float(), k3.float(), alpha=scale)


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


def _qk_norm(attn: nn.Module, heads: int, kv_heads: int) -> tuple[torch.Tensor | None, float]:
    """The per-head norms' weights, one row per q head then per kv head (None where the layer has none)."""
    if not hasattr(attn, "q_norm"):
        return None, 0.0
    q, k = attn.q_norm.weight.detach(), attn.k_norm.weight.detach()
    return torch.cat([q.expand(heads, -1), k.expand(kv_heads, -1)]).contiguous(), float(attn.q_norm.variance_epsilon)


def _apart(mods: list[nn.Linear]) -> list[Linear]:
    return [(m.weight.detach(), m.bias.detach() if m.bias is not None else None) for m in mods]


def fuse_layer(layer: nn.Module, concat: bool, config: object) -> FusedLayer:
    """One loaded layer's weights; with `concat`, q/k/v and gate/up concatenated (its HF modules then hold
    views of them). CPU workers keep them apart: their weights are views of the memory-mapped checkpoint,
    and launches are cheap there. A quantized layer's linears are called as the modules they are."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv_mods, gu_mods = [attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]
    w_o: torch.Tensor | nn.Module = attn.o_proj
    w_down: torch.Tensor | nn.Module = mlp.down_proj
    b_o = None
    if type(attn.q_proj) is not nn.Linear:  # quantized (workers/engine/quant.py)
        qkv, gate_up = list[Linear](qkv_mods), list[Linear](gu_mods)
    else:
        qkv, gate_up = ([_fuse(qkv_mods)], [_fuse(gu_mods)]) if concat else (_apart(qkv_mods), _apart(gu_mods))
        w_o, w_down = attn.o_proj.weight.detach(), mlp.down_proj.weight.detach()
        b_o = attn.o_proj.bias.detach() if attn.o_proj.bias is not None else None
    return FusedLayer(
        idx=attn.layer_idx,
        ln1=layer.input_layernorm.weight.detach(),
        eps1=float(layer.input_layernorm.variance_epsilon),
        qkv=qkv,
        w_o=w_o,
        b_o=b_o,
        ln2=layer.post_attention_layernorm.weight.detach(),
        eps2=float(layer.post_attention_layernorm.variance_epsilon),
        gate_up=gate_up,
        w_down=w_down,
        **_norms_of(layer, config),
    )


def _norms_of(layer: nn.Module, config: object) -> dict:
    if not hasattr(layer.self_attn, "q_norm"):
        return {}
    heads, kv_heads, _ = _heads(layer, config)
    qk_norm, eps = _qk_norm(layer.self_attn, heads, kv_heads)
    return {"qk_norm": qk_norm, "eps_qk": eps}


def fused_stack(first: nn.Module, parts: list[FusedLayer], config: object) -> FusedLayers:
    heads, kv_heads, head_dim = _heads(first, config)
    return FusedLayers(parts, heads, kv_heads, head_dim, float(first.self_attn.scaling))
