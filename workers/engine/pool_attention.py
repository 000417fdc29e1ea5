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
- several tokens a row (prompts, small batches): the tokens are the query rows and the g heads its heads (one
  key/value head), causal; a row's tokens sit at consecutive positions ending at used[b] - 1 (padding after the
  real ones, as every batch of workers/engine/runner.py is laid out);
- a batch's rounds: in two parts, merged (`attend`'s "split").
A batch's rounds (8 rows and more) whose rows may reach past `LONG_REACH` positions (the forward's `reach`: a bound
on every row's keys) read the pool in chunks (split-KV): each (row, head) sequence's keys as up to `chunk_count`
sequences of their own, the query rows repeated, the parts merged by their log-sum-exp, so a few dozen sequences of
thousands of keys do not each stream them in one thread block. Draft steps and one sequence's rounds read whole rows:
chunked, their kernels alone were faster (at 8,192 positions on an H200, a 0.5B drafter's 8 steps at one sequence 40.3
-> 23.6 ms), but the merge's ten kernels a layer cost more than that beside the other role's work on a shared GPU (the
job path with 4,000-token prompts: one job 16.9 tok/s and 8 jobs 82 chunked, 18.9 and 98 not; docs/runs/journal.md,
runs 82-85). Padding rows (`pad`: the pool's padding slot) read t keys, not the slot's scratch at its end.
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

# (q, flat keys, flat values, layout, scale, causal) -> (out [total_q, heads, d], log-sum-exp [heads, total_q])
Kernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]


# Rows of several tokens (rounds) from this batch size on attend in two parts (see `attend`); below it, per head.
SPLIT_MIN_BATCH = 8
SPLIT_MAX_TOKENS = 16  # ... for rounds of up to this many tokens a row (longer steps, prompts: per head, causal)
# A batch's rounds whose rows may reach past this many positions read keys in chunks; engines capture a graph for
# each side of it (workers/engine/runner.py `Engine.attended`)
LONG_REACH = 1024
CHUNK_MIN_KEYS = 256  # keys a chunk holds at least
CHUNK_TARGET = 264  # (sequence, chunk) pairs a call aims at: two waves of an H200's 132 SMs


@dataclass(frozen=True)
class Layout:
    """Variable-length attention arguments of one forward over a pool: see the module docstring and `attend`."""

    cu_q: torch.Tensor  # int32 [n + 1]: query row offsets of each (row, key/value head)
    cu_k: torch.Tensor  # int32 [n + 1]: key offsets in the flat pool (the last one unused)
    used: torch.Tensor  # int32 [n]: keys each uses
    max_q: int
    max_k: int
    mode: str  # "fold" (one token), "heads" (causal, a head per query head), "split" (see `attend`)
    bias: torch.Tensor | None = None  # split: [t * g, t - 1] 0 / -inf, which of a round's later tokens a row sees
    chunks: int = 1  # each (row, head)'s keys read as this many sequences (see the module docstring)


def chunk_count(sequences: int, reach: int) -> int:
    """Chunks each of `sequences` (row, head) sequences reading up to `reach` keys is read in: enough for
    CHUNK_TARGET in all, of CHUNK_MIN_KEYS keys at least; 1 up to LONG_REACH."""
    if reach <= LONG_REACH:
        return 1
    return max(1, min(-(-CHUNK_TARGET // sequences), -(-reach // CHUNK_MIN_KEYS)))


def layout(
    rows: torch.Tensor,
    last: torch.Tensor,
    t: int,
    kv_heads: int,
    g: int,
    length: int,
    reach: int | None = None,
    pad: int | None = None,
    chunks: int | None = None,
) -> Layout:
    """The layout of a batch whose row b is slot rows[b] with its last token at position last[b], t tokens a
    row, over a pool of `length` positions a slot, no row's keys past `reach` (default: length), padding rows in
    slot `pad`, keys in `chunks` chunks (default: `chunk_count`'s; device ops only)."""
    dev, reach = rows.device, min(reach or length, length)
    heads = torch.arange(kv_heads, device=dev, dtype=torch.int32)
    starts = ((rows.to(torch.int32)[:, None] * kv_heads + heads) * length).flatten()
    split = t <= SPLIT_MAX_TOKENS and rows.shape[0] >= SPLIT_MIN_BATCH
    mode = "fold" if t == 1 else "split" if split else "heads"
    seen = last.to(torch.int32) + 1 - (t - 1 if mode == "split" else 0)  # split: up to the round's first token
    if pad is not None:  # a padding row's keys are never read: t of them are enough for every mode
        seen = torch.where(rows == pad, seen.clamp(max=t), seen)
    used = seen[:, None].expand(-1, kv_heads).contiguous().flatten()  # (contiguous: at one row no stride 0)
    if mode == "heads":  # causal: never in chunks
        chunks = 1
    elif chunks is None:  # (given: `chunks_agree`'s check of the merge)
        chunks = chunk_count(starts.shape[0], reach) if mode == "split" else 1
    max_k = length
    if chunks > 1:  # sequence i's chunk c: its keys c * size .. (c + 1) * size - 1
        max_k = -(-reach // chunks)
        offsets = torch.arange(chunks, device=dev, dtype=torch.int32) * max_k
        starts = (starts[:, None] + offsets).flatten()
        used = (used[:, None] - offsets).clamp(0, max_k).flatten()
    n = starts.shape[0]
    cu_k = torch.cat([starts, starts.new_zeros(1)])
    per = {"fold": g, "heads": t, "split": t * g}[mode]
    cu_q = torch.arange(0, (n + 1) * per, per, device=dev, dtype=torch.int32)
    bias = later_bias(t, g, dev) if mode == "split" else None
    return Layout(cu_q, cu_k, used, per, max_k, mode, bias, chunks)


def later_bias(t: int, g: int, dev: torch.device) -> torch.Tensor:
    """[t * g, t - 1] 0 / -inf: row (token i, head j) of a round sees the round's token j' >= 1 when j' <= i."""
    tok = torch.arange(t, device=dev).repeat_interleave(g)[:, None]
    later = torch.arange(1, t, device=dev)[None] > tok
    return torch.zeros(t * g, t - 1, device=dev).masked_fill(later, -torch.inf)


def chunked(
    kernel: Kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lay: Layout, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernel` (not causal) over a layout whose sequences are read in `lay.chunks` chunks: each sequence's query
    rows q [n * per, heads, d] repeated for its chunks, the chunks' outputs merged by their log-sum-exps (float32; a
    chunk with no keys weighs nothing). Returns what one call over whole sequences returns."""
    c, per, heads, d = lay.chunks, lay.max_q, q.shape[1], q.shape[2]
    if c == 1:
        return kernel(q, k, v, lay, scale, False)
    n = q.shape[0] // per
    wide = q.reshape(n, 1, per * heads * d).expand(n, c, -1).reshape(-1, heads, d)
    out, lse = kernel(wide, k, v, lay, scale, False)
    empty = (lay.used == 0).view(n, c, 1, 1)
    part = lse.view(heads, n, c, per).permute(1, 2, 3, 0).masked_fill(empty, -torch.inf)  # [n, c, per, heads]
    weight = torch.softmax(part, dim=1)
    outs = out.view(n, c, per, heads, d).float().masked_fill(empty[..., None], 0.0)  # an empty chunk: no output
    merged = (outs * weight[..., None]).sum(1)
    return merged.reshape(n * per, heads, d).to(q.dtype), torch.logsumexp(part, 1).permute(2, 0, 1).reshape(heads, -1)


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    lay: Layout,
    scale: float,
    kernel: Kernel,
    new: tuple[torch.Tensor, torch.Tensor] | None = None,
    merge: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """q [B, T, hq, d] against one layer's pool keys/values [slots, hkv, L, d] (this step's keys and values `new`
    [B, hkv, T, d] already written there); returns [B * T, hq * d].

    - fold (T = 1): each (row, group)'s g heads are the query rows of one sequence, not causal;
    - heads: the T tokens are the rows and the group's g heads its heads (one key/value head), causal;
    - split (rounds of a batch): FlashAttention's tiles are 64-128 query rows, so a round's 9 rows a head would
      leave most of each tile idle (on an H200, 331 us a 7B layer at 128 rows). Every token of a round sees the
      pool up to the round's first token, so all T x g rows of a group attend there as one sequence, not causal;
      the round's later T - 1 tokens (causal among themselves) are added here, their scores merged with the
      kernel's log-sum-exp (float32): `merge_later`, or `merge` (its one Triton kernel on CUDA,
      decode_kernels.merge_kernel) where given."""
    b, t, hq, d = q.shape
    hkv = keys.shape[1]
    g = hq // hkv
    flat_k, flat_v = keys.view(-1, 1, d), values.view(-1, 1, d)
    if lay.mode == "fold":  # [B * hkv * g, 1, d]
        return chunked(kernel, q.reshape(b * hkv * g, 1, d), flat_k, flat_v, lay, scale)[0].reshape(b, hq * d)
    if lay.mode == "heads":  # [B * hkv * T, g, d]
        q2 = q.reshape(b, t, hkv, g, d).transpose(1, 2).reshape(b * hkv * t, g, d)
        out = kernel(q2, flat_k, flat_v, lay, scale, True)[0]
        return out.view(b, hkv, t, g, d).transpose(1, 2).reshape(b * t, hq * d)
    assert new is not None and lay.bias is not None
    q2 = q.reshape(b, t, hkv, g, d).transpose(1, 2).reshape(b * hkv * t * g, 1, d)
    first, lse = chunked(kernel, q2, flat_k, flat_v, lay, scale)
    n = b * hkv
    q3, first, lse = q2.view(n, t * g, d), first.view(n, t * g, d), lse.view(n, t * g)
    out = merge(q3, first, lse, new, scale) if merge is not None else merge_later(q3, first, lse, new, lay.bias, scale)
    return out.view(b, hkv, t, g, d).transpose(1, 2).reshape(b * t, hq * d)


def merge_later(
    q: torch.Tensor,
    first: torch.Tensor,
    lse: torch.Tensor,
    new: tuple[torch.Tensor, torch.Tensor],
    bias: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Softmax over [keys up to the round's first token, the round's later tokens]: q [n, T * g, d], `first` the
    attention over the former with its log-sum-exp `lse` [n, T * g]; new keys/values [B, hkv, T, d] (n = B x hkv)."""
    n, d = q.shape[0], q.shape[2]
    k2 = new[0][:, :, 1:].reshape(n, -1, d).float()
    v2 = new[1][:, :, 1:].reshape(n, -1, d).float()
    s2 = torch.baddbmm(bias, q.float(), k2.transpose(1, 2), alpha=scale)
    top = torch.maximum(lse, s2.amax(-1))  # finite: every row sees at least the round's first token
    w1 = torch.exp(lse - top)
    e2 = torch.exp(s2 - top[..., None])
    num = torch.baddbmm(first.float() * w1[..., None], e2, v2)
    return (num / (w1 + e2.sum(-1))[..., None]).to(q.dtype)


def flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lay: Layout, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's FlashAttention-2, variable length (CUDA, float16/bfloat16): (out [total_q, heads, d], log-sum-exp
    [heads, total_q], float32)."""
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, lay.cu_q, lay.cu_k, lay.max_q, lay.max_k, 0.0, causal, False, scale=scale, seqused_k=lay.used
    )
    return out[0], out[1]


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lay: Layout, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """What `flash` computes, with a gather and plain ops (float32 softmax at least): q [n * max_q, heads, d], flat
    k/v [positions, 1, d]."""
    n, per, heads, d = lay.used.shape[0], lay.max_q, q.shape[1], q.shape[2]
    idx = lay.cu_k[:-1, None].long() + torch.arange(lay.max_k, device=q.device)
    idx = idx.clamp(max=k.shape[0] - 1)
    wide = torch.promote_types(q.dtype, torch.float32)
    keys, vals = k[idx, 0].to(wide), v[idx, 0].to(wide)  # [n, max_k, d]
    cols = torch.arange(lay.max_k, device=q.device)
    used = lay.used.long()[:, None, None]
    mask = cols[None, None] < used  # [n, 1, max_k]
    if causal:  # query row j of a sequence sees keys up to used - per + j
        mask = mask & (cols[None, None] <= used - per + torch.arange(per, device=q.device)[None, :, None])
    qs = q.view(n, per, heads, d).transpose(1, 2).to(wide)  # [n, heads, per, d]
    scores = (qs @ keys[:, None].transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask[:, None], -torch.inf)
    lse = torch.logsumexp(scores, -1)  # [n, heads, per]
    out = torch.exp(scores - lse[..., None]) @ vals[:, None]
    out = out.transpose(1, 2).reshape(n * per, heads, d).to(q.dtype)
    return out, lse.permute(1, 0, 2).reshape(heads, n * per)


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
    `reference`, causal and not: whether outputs and log-sum-exps agree."""
    gen = torch.Generator(device=device).manual_seed(0)
    keys = torch.randn(3, 2, 32, head_dim, device=device, dtype=dtype, generator=gen)
    values = torch.randn(3, 2, 32, head_dim, device=device, dtype=dtype, generator=gen)
    flat_k, flat_v = keys.view(-1, 1, head_dim), values.view(-1, 1, head_dim)
    lay = layout(torch.tensor([2, 0], device=device), torch.tensor([20, 9], device=device), 3, 2, 4, 32)
    q = torch.randn(4 * 3, 4, head_dim, device=device, dtype=dtype, generator=gen)
    for causal in (False, True):
        (o1, l1), (o2, l2) = (k(q, flat_k, flat_v, lay, head_dim**-0.5, causal) for k in (flash, reference))
        if not (torch.allclose(o1.float(), o2.float(), atol=2e-2, rtol=2e-2) and torch.allclose(l1, l2, atol=1e-2)):
            return False
    return chunks_agree(flash, device, dtype, head_dim)


def chunks_agree(kernel: Kernel, device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether `kernel` over keys in chunks (rows of 1,500 and 9 positions of 2,048: most chunks empty, which
    FlashAttention answers with a log-sum-exp of +inf) merges to what `reference` gives over whole rows."""
    gen = torch.Generator(device=device).manual_seed(1)
    keys = torch.randn(3, 2, 2048, head_dim, device=device, dtype=dtype, generator=gen)
    flat_k, flat_v = keys.view(-1, 1, head_dim), keys.flip(2).reshape(-1, 1, head_dim)
    rows, last = torch.tensor([2, 0], device=device), torch.tensor([1500, 9], device=device)
    q = torch.randn(2 * 2 * 4, 1, head_dim, device=device, dtype=dtype, generator=gen)
    whole, parts = (layout(rows, last, 1, 2, 4, 2048, chunks=c) for c in (1, 8))
    o1, l1 = chunked(kernel, q, flat_k, flat_v, parts, head_dim**-0.5)
    o2, l2 = reference(q, flat_k, flat_v, whole, head_dim**-0.5, False)
    return torch.allclose(o1.float(), o2.float(), atol=2e-2, rtol=2e-2) and torch.allclose(l1, l2, atol=1e-2)
