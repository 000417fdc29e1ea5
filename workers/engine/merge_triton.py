"""The Triton kernel of `pool_attention.merge_later` (built by decode_kernels.merge_kernel; imported only where Triton
runs): a batch's rounds attend over the pool up to each round's first token in FlashAttention, then add the round's
later tokens, causal among themselves. In torch that merge is about ten kernels a layer over float32 copies of the
queries and of the first part (at 128 sequences of a 7B round, 1.3 ms of the head's 15.7 on an H100, run 122); here it
is one, a program per (sequence, key/value head) and block of query rows, in float32 as torch's."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS = 64  # query rows (a round's tokens x the query heads of a group) a program takes
LATER = 16  # a round's later tokens a program holds at most (SPLIT_MAX_TOKENS - 1, padded for tl.dot)


@triton.jit(do_not_specialize=["rows", "g", "t", "hkv", "skb", "skh", "skt", "svb", "svh", "svt"])
def _merge_later_kernel(
    q_ptr, first_ptr, lse_ptr, k_ptr, v_ptr, out_ptr, scale, rows, g, t, hkv, skb, skh, skt, svb, svh, svt,
    D: tl.constexpr, BR: tl.constexpr, BT: tl.constexpr,
):  # fmt: skip
    """out = softmax over [the first part (its attention `first` and log-sum-exp `lse`), the later tokens' keys] of
    the rows' scores, times [first, their values]: query row r (token r // g of the round, head r % g) sees later token
    c + 1 iff c + 1 <= r // g. Keys/values [B, hkv, t, D] at the given strides (the last one 1)."""
    n, blk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    b, h = n // hkv, n % hkv
    r = blk * BR + tl.arange(0, BR)
    c, d = tl.arange(0, BT), tl.arange(0, D)
    rm, cm = r < rows, c < t - 1
    at = n * rows * D + r[:, None] * D + d[None, :]
    q = tl.load(q_ptr + at, mask=rm[:, None], other=0.0).to(tl.float32)
    k2 = tl.load(k_ptr + b * skb + h * skh + (c + 1)[:, None] * skt + d[None, :], mask=cm[:, None], other=0.0)
    v2 = tl.load(v_ptr + b * svb + h * svh + (c + 1)[:, None] * svt + d[None, :], mask=cm[:, None], other=0.0)
    s2 = tl.dot(q, tl.trans(k2.to(tl.float32)), input_precision="ieee") * scale
    s2 = tl.where(cm[None, :] & (c[None, :] + 1 <= r[:, None] // g), s2, float("-inf"))
    lse = tl.load(lse_ptr + n * rows + r, mask=rm, other=0.0)
    top = tl.maximum(lse, tl.max(s2, 1))  # finite: every row sees the first part
    w1 = tl.exp(lse - top)
    e2 = tl.exp(s2 - top[:, None])
    first = tl.load(first_ptr + at, mask=rm[:, None], other=0.0).to(tl.float32)
    num = first * w1[:, None] + tl.dot(e2, v2.to(tl.float32), input_precision="ieee")
    out = num / (w1 + tl.sum(e2, 1))[:, None]
    tl.store(out_ptr + at, out.to(out_ptr.dtype.element_ty), mask=rm[:, None])


def merge_later(
    q: torch.Tensor, first: torch.Tensor, lse: torch.Tensor, new: tuple[torch.Tensor, torch.Tensor], scale: float
) -> torch.Tensor:
    """`pool_attention.merge_later` as one kernel: q, first [n, T * g, d], lse [n, T * g] float32, new keys/values
    [B, hkv, T, d] (n = B x hkv, their last stride 1); returns [n, T * g, d] in q's dtype."""
    n, rows, d = q.shape
    k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in new)
    hkv, t = k.shape[1], k.shape[2]
    q, first, lse = q.contiguous(), first.contiguous(), lse.contiguous()
    out = torch.empty_like(q)
    grid = (n, triton.cdiv(rows, ROWS))
    _merge_later_kernel[grid](
        q, first, lse, k, v, out, scale, rows, rows // t, t, hkv, *k.stride()[:3], *v.stride()[:3],
        D=d, BR=ROWS, BT=LATER,
    )  # fmt: skip
    return out


def fits(head_dim: int, tokens: int) -> bool:
    """Whether the kernel takes a head this wide (a power of two, at least 16: tl.dot's; at most 128: a program holds
    three [64 x head_dim] float32 tiles, and wider ones, Gemma 3's 256, would spill) and rounds this long."""
    return 16 <= head_dim <= 128 and head_dim & (head_dim - 1) == 0 and tokens - 1 <= LATER
