"""Attention that reads a batch's keys and values where they sit in a `KVPool`: no per-layer copy of them.

A pool holds [slots, kv_heads, L, head_dim] per layer, so one (slot, key/value head) is a contiguous run of L
positions, and the whole pool is one flat sequence of slots x kv_heads x L positions of one head. Each row b of a
batch and key/value head i is then one "sequence" of a variable-length attention call: its keys start at
(rows[b] x kv_heads + i) x L of that flat sequence and it uses the first used[b] = (position of its last token +
1) of them; its queries are its tokens' query heads of that group (i x g .. i x g + g - 1). The kernel is the
FlashAttention-2 that torch ships (`torch.ops.aten._flash_attention_forward`, varlen with `seqused_k`: offsets
need not be increasing), float32 softmax, causal aligned to the end of each row's keys:
- one token a row (a draft step): the g query heads of a group are the g query rows of one sequence, not causal
  (each sees every key up to its own), so each group's keys are read once;
- several tokens a row (rounds, prompts): the tokens are the query rows and the g heads its heads (one key/value
  head), causal; a row's tokens sit at consecutive positions ending at used[b] - 1 (padding after the real ones,
  as every batch of workers/engine/runner.py is laid out).
Attention thus follows each row's real length (no attended-length buckets, no graph per length) and builds no
mask. FlashAttention-2 runs on sm_80+ in float16/bfloat16 (head_dim a multiple of 8, at most 256); elsewhere
(`supported`) the shards gather as before (workers/engine/kvcache.py `BatchView`). `reference` computes the same
layout with plain tensor ops (any device and dtype): tests run the in-place path through it on the CPU.

One call's arguments (`Layout`) are built once per forward and shared by its layers (device tensors: a forward
that builds them is graph-capturable).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
from torch.nn import functional as F

Kernel = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class Layout:
    """Variable-length attention arguments of one forward over a pool: see the module docstring."""

    cu_q: torch.Tensor  # int32 [n + 1]: query row offsets of each (row, key/value head)
    cu_k: torch.Tensor  # int32 [n + 1]: key offsets in the flat pool (the last one unused)
    used: torch.Tensor  # int32 [n]: keys each uses
    max_q: int
    max_k: int
    t: int  # tokens a row
    causal: bool


def layout(rows: torch.Tensor, last: torch.Tensor, t: int, kv_heads: int, g: int, length: int) -> Layout:
    """The layout of a batch whose row b is slot rows[b] with its last token at position last[b], t tokens a
    row, over a pool of `length` positions a slot (device ops only)."""
    dev = rows.device
    heads = torch.arange(kv_heads, device=dev, dtype=torch.int32)
    starts = ((rows.to(torch.int32)[:, None] * kv_heads + heads) * length).flatten()
    n = starts.shape[0]
    cu_k = torch.cat([starts, starts.new_zeros(1)])
    used = (last.to(torch.int32) + 1)[:, None].expand(-1, kv_heads).contiguous().flatten()  # (B = 1: no stride 0)
    per = g if t == 1 else t
    cu_q = torch.arange(0, (n + 1) * per, per, device=dev, dtype=torch.int32)
    return Layout(cu_q, cu_k, used, per, length, t, causal=t > 1)


def attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lay: Layout, scale: float, kernel: Kernel
) -> torch.Tensor:
    """q [B, T, hq, d] against one layer's pool keys/values [slots, hkv, L, d]; returns [B * T, hq * d]."""
    b, t, hq, d = q.shape
    hkv = keys.shape[1]
    g = hq // hkv
    flat_k, flat_v = keys.view(-1, 1, d), values.view(-1, 1, d)
    if t == 1:  # [B * hkv * g, 1, d]: a group's heads are one sequence's query rows
        q2 = q.reshape(b * hkv * g, 1, d)
    else:  # [B * hkv * T, g, d]: a group's tokens are the rows, its heads the heads
        q2 = q.reshape(b, t, hkv, g, d).transpose(1, 2).reshape(b * hkv * t, g, d)
    out = kernel(q2, flat_k, flat_v, lay, scale)
    if t == 1:
        return out.reshape(b, hq * d)
    return out.view(b, hkv, t, g, d).transpose(1, 2).reshape(b * t, hq * d)


def flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lay: Layout, scale: float) -> torch.Tensor:
    """torch's FlashAttention-2, variable length (CUDA, float16/bfloat16)."""
    return torch.ops.aten._flash_attention_forward(
        q, k, v, lay.cu_q, lay.cu_k, lay.max_q, lay.max_k, 0.0, lay.causal, False, scale=scale, seqused_k=lay.used
    )[0]


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lay: Layout, scale: float) -> torch.Tensor:
    """What `flash` computes, with a gather and SDPA (float32 softmax at least): q [n * max_q, heads, d], flat k/v
    [positions, 1, d]; returns [n * max_q, heads, d]."""
    n, per, heads, d = lay.used.shape[0], lay.max_q, q.shape[1], q.shape[2]
    idx = lay.cu_k[:-1, None].long() + torch.arange(lay.max_k, device=q.device)
    idx = idx.clamp(max=k.shape[0] - 1)
    keys, vals = k[idx, 0], v[idx, 0]  # [n, max_k, d]
    cols = torch.arange(lay.max_k, device=q.device)
    used = lay.used.long()[:, None, None]
    mask = cols[None, None] < used  # [n, 1, max_k]
    if lay.causal:  # query row j of a sequence sees keys up to used - per + j
        mask = mask & (cols[None, None] <= used - per + torch.arange(per, device=q.device)[None, :, None])
    wide = torch.promote_types(q.dtype, torch.float32)
    qs = q.view(n, per, heads, d).transpose(1, 2).to(wide)  # [n, heads, per, d]
    out = F.scaled_dot_product_attention(
        qs, keys[:, None].to(wide), vals[:, None].to(wide), attn_mask=mask[:, None], scale=scale
    )
    return out.transpose(1, 2).reshape(n * per, heads, d).to(q.dtype)


@cache
def supported(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether `flash` runs here: CUDA sm_80+, float16/bfloat16, head_dim a multiple of 8 up to 256, and a probe
    call of this layout agreeing with `reference` (probed once per device, dtype and head size, at load)."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16) or head_dim % 8 or head_dim > 256:
        return False
    if torch.cuda.get_device_capability(device) < (8, 0):
        return False
    try:
        return probe(device, dtype, head_dim)
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def probe(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """One small pool (3 slots, 2 key/value heads, 4 query heads each, 32 positions) through `flash` and
    `reference`, one token and three tokens a row: whether they agree."""
    gen = torch.Generator(device=device).manual_seed(0)
    keys = torch.randn(3, 2, 32, head_dim, device=device, dtype=dtype, generator=gen)
    values = torch.randn(3, 2, 32, head_dim, device=device, dtype=dtype, generator=gen)
    rows = torch.tensor([2, 0], device=device)
    for t in (1, 3):
        q = torch.randn(2, t, 8, head_dim, device=device, dtype=dtype, generator=gen)
        lay = layout(rows, torch.tensor([20, 9], device=device), t, 2, 4, 32)
        got = attend(q, keys, values, lay, head_dim**-0.5, flash).float()
        want = attend(q, keys, values, lay, head_dim**-0.5, reference).float()
        if not torch.allclose(got, want, atol=2e-2, rtol=2e-2):
            return False
    return True
