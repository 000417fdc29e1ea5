"""The fused layers' kernels (workers/engine/fused.py): rotary embeddings as one matmul by a per-position rotation
(or elementwise under torch.compile), and attention as GEMMs with grouped-query heads folded into the query rows,
or through torch's scaled_dot_product_attention."""

from __future__ import annotations

import torch
from torch.nn import functional as F


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


def full_width(cos_sin: tuple[torch.Tensor, torch.Tensor], head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin as wide as a head: gpt-oss's rotary gives half (its halves rotate by the same angles)."""
    cos, sin = cos_sin
    if cos.shape[-1] * 2 != head_dim:
        return cos_sin
    return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)


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
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, T, hq, d] against keys/values [B, hkv, L, d]; returns [B * T, hq * d].

    Query head h = i * g + j uses key/value head i, so queries are regrouped as [B * hkv, g * T, d]
    and multiply the caches as they are. `sinks` [hq] (gpt-oss): a logit per head that takes part in the softmax
    and attends to nothing (a column of the scores, dropped after it)."""
    b, t, hq, d = q.shape
    hkv, length = keys.shape[1], keys.shape[2]
    g = hq // hkv
    q3 = q.reshape(b, t, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b * hkv, g * t, d)
    k3 = keys.reshape(b * hkv, length, d).transpose(1, 2)
    wide = score_dtype(q)
    if bias is None:
        bias = torch.zeros((), dtype=wide, device=q.device).expand(b * hkv, g * t, length)
    if wide != q.dtype:  # bf16/fp16 on CUDA: float32 scores from the half GEMM, probabilities back in half
        scores = _wide_scores(bias, q3, k3, scale, wide_gemm)
    else:
        scores = torch.baddbmm(bias, q3, k3, alpha=scale)
    if sinks is None:
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
    else:
        col = sinks.to(scores.dtype).view(1, hkv, g, 1, 1).expand(b, hkv, g, t, 1).reshape(b * hkv, g * t, 1)
        probs = torch.softmax(torch.cat([scores, col], dim=-1), dim=-1)[..., :length].to(q.dtype)
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
