"""The Triton kernels of workers/engine/decode_kernels.py and their launches (imported only where Triton runs)."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl


@triton.jit
def _normed_gemv_kernel(
    x_ptr, ln_ptr, w_ptr, b_ptr, out_ptr, width, n_out, eps,
    HAS_BIAS: tl.constexpr, GATED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[row] = w @ RMSNorm(x[row]) (+ b), or with GATED SiLU(gate) * up of it (gate: w's first n_out rows, up:
    the next n_out). A row is at most BLOCK_K wide: one load each, so a program's loads are all in flight at once."""
    pid, row = tl.program_id(0), tl.program_id(1)
    ty = x_ptr.dtype.element_ty
    kk = tl.arange(0, BLOCK_K)
    km = kk < width
    xv = tl.load(x_ptr + row * width + kk, mask=km, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xv * xv, 0) / width + eps)
    xv = (xv * rstd * tl.load(ln_ptr + kk, mask=km, other=0.0).to(tl.float32)).to(ty).to(tl.float32)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < n_out
    mask = nm[:, None] & km[None, :]
    wt = tl.load(w_ptr + n[:, None] * width + kk[None, :], mask=mask, other=0.0).to(tl.float32)
    acc = tl.sum(wt * xv[None, :], 1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=nm, other=0.0).to(tl.float32)
    acc = acc.to(ty).to(tl.float32)
    if GATED:
        up = tl.load(w_ptr + (n_out + n)[:, None] * width + kk[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.sum(up * xv[None, :], 1).to(ty).to(tl.float32)
        acc = (acc / (1.0 + tl.exp(-acc))).to(ty).to(tl.float32) * up
    tl.store(out_ptr + row * n_out + n, acc.to(ty), mask=nm)


@triton.jit
def _rope_write_kernel(
    qkv_ptr, qkn_ptr, cos_ptr, sin_ptr, slot_ptr, pos_ptr, q_ptr, k_ptr, v_ptr, length, eps_qk,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, QK_NORM: tl.constexpr,
):  # fmt: skip
    """One head of one row's q/k/v: Qwen3's per-head norm and the rotary for q and k; q to `q`, the key and value
    into the pool at the row's slot and position. In half precision it rounds where the fused forward does: the normed
    head, then its weighted head (F.rms_norm, then a product), each to the working dtype; the rotary once (the fused
    forward's one matmul by a rotation); in float32 the roundings are no-ops."""
    head, row = tl.program_id(0), tl.program_id(1)
    ty = qkv_ptr.dtype.element_ty
    half: tl.constexpr = D // 2
    n = tl.arange(0, half)
    src = qkv_ptr + (row * (HQ + 2 * HKV) + head) * D
    a1 = tl.load(src + n).to(tl.float32)
    a2 = tl.load(src + half + n).to(tl.float32)
    if head < HQ + HKV:
        if QK_NORM:
            r = 1.0 / tl.sqrt((tl.sum(a1 * a1, 0) + tl.sum(a2 * a2, 0)) / D + eps_qk)
            w1 = tl.load(qkn_ptr + head * D + n).to(tl.float32)
            w2 = tl.load(qkn_ptr + head * D + half + n).to(tl.float32)
            a1 = ((a1 * r).to(ty).to(tl.float32) * w1).to(ty).to(tl.float32)
            a2 = ((a2 * r).to(ty).to(tl.float32) * w2).to(ty).to(tl.float32)
        c1 = tl.load(cos_ptr + row * D + n)  # float32 already (DecodeLayers._run)
        c2 = tl.load(cos_ptr + row * D + half + n)
        s1 = tl.load(sin_ptr + row * D + n)
        s2 = tl.load(sin_ptr + row * D + half + n)
        o1 = a1 * c1 - a2 * s1  # rounded once, at the store: as the fused forward's x @ R (fused_ops.rotation)
        o2 = a2 * c2 + a1 * s2
    else:
        o1 = a1
        o2 = a2
    if head < HQ:
        dst = q_ptr + row * HQ * D + head * D
    else:
        slot = tl.load(slot_ptr + row)
        pos = tl.load(pos_ptr + row)
        if head < HQ + HKV:
            dst = k_ptr + ((slot * HKV + head - HQ) * length + pos) * D
        else:
            dst = v_ptr + ((slot * HKV + head - HQ - HKV) * length + pos) * D
    tl.store(dst + n, o1.to(ty))
    tl.store(dst + half + n, o2.to(ty))


@triton.jit
def _attend_kernel(
    q_ptr, k_ptr, v_ptr, slot_ptr, pos_ptr, part_ptr, scale, length, pad_slot,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    """One (head, row, split): the split's share of the row's keys 0..pos, as float32 partials [acc (D), max, sum]. A
    padding row (in the pool's pad slot, at scratch positions near its end) reads one key: its output is unused."""
    head, row, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kvh = head // (HQ // HKV)
    slot = tl.load(slot_ptr + row)
    n_keys = tl.where(slot == pad_slot, 1, tl.load(pos_ptr + row) + 1)
    chunk = (n_keys + SPLITS - 1) // SPLITS
    lo = split * chunk
    hi = tl.minimum(lo + chunk, n_keys)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + row * HQ * D + head * D + d).to(tl.float32) * scale
    base = (slot * HKV + kvh) * length * D
    j0 = tl.arange(0, BLOCK_N)
    m = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), 0)
    total = tl.sum(tl.zeros([BLOCK_N], tl.float32), 0)
    acc = tl.zeros([D], tl.float32)
    for s in range(lo, hi, BLOCK_N):
        j = s + j0
        jm = j < hi
        kt = tl.load(k_ptr + base + j[:, None] * D + d[None, :], mask=jm[:, None], other=0.0).to(tl.float32)
        vt = tl.load(v_ptr + base + j[:, None] * D + d[None, :], mask=jm[:, None], other=0.0).to(tl.float32)
        sc = tl.where(jm, tl.sum(kt * q[None, :], 1), float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, 0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(sc - m_new)
        total = total * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * vt, 0)
        m = m_new
    dst = part_ptr + ((row * HQ + head) * SPLITS + split) * (D + 2)
    tl.store(dst + d, acc)
    tl.store(dst + D, m)
    tl.store(dst + D + 1, total)


@triton.jit
def _attend_group_kernel(
    q_ptr, k_ptr, v_ptr, slot_ptr, pos_ptr, o_ptr, part_ptr, scale, length, pad_slot,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, G: tl.constexpr, T: tl.constexpr, RP: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, HALF: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """`_attend_kernel` for one (key/value head, sequence, split) and its T x G query rows (the sequence's T token rows,
    in one slot, times the G query heads sharing this key/value head; padded to RP >= 16): each block of keys and
    values is read once for all of them, scores and sums as matrix products, each row masked to the positions up to
    its own (causal within a round). HALF: half-precision operands (the probabilities rounded to them, as
    FlashAttention rounds them), else float32 ones at PREC ("tf32" holds half-precision values exactly; "ieee" for
    float32 weights, and Triton's interpreter). One split writes `o` itself; more write partials to merge."""
    kvh, seq, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    r, d, j0 = tl.arange(0, RP), tl.arange(0, D), tl.arange(0, BLOCK_N)
    rm = r < T * G
    row = seq * T + r // G
    heads = kvh * G + r % G
    slot = tl.load(slot_ptr + seq * T)
    see = tl.load(pos_ptr + row, mask=rm, other=0)
    n_keys = tl.where(slot == pad_slot, 1, tl.max(see, 0) + 1)
    chunk = (n_keys + SPLITS - 1) // SPLITS
    lo = split * chunk
    hi = tl.minimum(lo + chunk, n_keys)
    ty = q_ptr.dtype.element_ty
    q = tl.load(q_ptr + (row * HQ + heads)[:, None] * D + d[None, :], mask=rm[:, None], other=0.0)
    if not HALF:
        q = q.to(tl.float32)
    base = (slot * HKV + kvh) * length * D
    m = tl.full([RP], float("-inf"), tl.float32)
    total = tl.zeros([RP], tl.float32)
    acc = tl.zeros([RP, D], tl.float32)
    for s in range(lo, hi, BLOCK_N):
        j = s + j0
        jm = j < hi
        kt = tl.load(k_ptr + base + j[:, None] * D + d[None, :], mask=jm[:, None], other=0.0)
        vt = tl.load(v_ptr + base + j[:, None] * D + d[None, :], mask=jm[:, None], other=0.0)
        if HALF:
            sc = tl.dot(q, tl.trans(kt)) * scale
        else:
            sc = tl.dot(q, tl.trans(kt.to(tl.float32)), input_precision=PREC) * scale
        sc = tl.where(jm[None, :] & (j[None, :] <= see[:, None]), sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees no key here yet: nothing to scale
        alpha = tl.exp(m - m_use)
        p = tl.exp(sc - m_use[:, None])
        total = total * alpha + tl.sum(p, 1)
        if HALF:
            acc = acc * alpha[:, None] + tl.dot(p.to(ty), vt)
        else:
            acc = acc * alpha[:, None] + tl.dot(p, vt.to(tl.float32), input_precision=PREC)
        m = m_new
    if SPLITS == 1:  # every row sees key 0 at least: total > 0
        dst = o_ptr + (row * HQ + heads)[:, None] * D + d[None, :]
        tl.store(dst, (acc / total[:, None]).to(o_ptr.dtype.element_ty), mask=rm[:, None])
    else:
        dst = part_ptr + ((row * HQ + heads) * SPLITS + split) * (D + 2)
        tl.store(dst[:, None] + d[None, :], acc, mask=rm[:, None])
        tl.store(dst + D, m, mask=rm)
        tl.store(dst + D + 1, total, mask=rm)


@triton.jit
def _attend_merge_kernel(part_ptr, o_ptr, HQ: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr):
    """One (head, row): its splits' partials merged by their maxima (a split with no keys weighs nothing)."""
    head, row = tl.program_id(0), tl.program_id(1)
    ty = o_ptr.dtype.element_ty
    sp, d = tl.arange(0, SPLITS), tl.arange(0, D)
    src = part_ptr + (row * HQ + head) * SPLITS * (D + 2) + sp * (D + 2)
    m = tl.load(src + D)
    w = tl.exp(m - tl.max(m, 0))
    total = tl.sum(w * tl.load(src + D + 1), 0)
    acc = tl.sum(w[:, None] * tl.load(src[:, None] + d[None, :]), 0)
    tl.store(o_ptr + row * HQ * D + head * D + d, (acc / total).to(ty))


@triton.jit
def _gemv_residual_kernel(
    a_ptr, w_ptr, r_ptr, out_ptr, n_out, k_in, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):  # fmt: skip
    """out[row] = r[row] + w @ a[row] (one rounding, as an addmm); rows of a at most BLOCK_K wide (one load)."""
    pid, row = tl.program_id(0), tl.program_id(1)
    ty = r_ptr.dtype.element_ty
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < n_out
    kk = tl.arange(0, BLOCK_K)
    km = kk < k_in
    av = tl.load(a_ptr + row * k_in + kk, mask=km, other=0.0).to(tl.float32)
    wt = tl.load(w_ptr + n[:, None] * k_in + kk[None, :], mask=nm[:, None] & km[None, :], other=0.0)
    acc = tl.sum(wt.to(tl.float32) * av[None, :], 1)
    acc += tl.load(r_ptr + row * n_out + n, mask=nm, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_out + n, acc.to(ty), mask=nm)


@triton.jit
def _rms_norm_kernel(x_ptr, ln_ptr, out_ptr, width, eps, BLOCK_K: tl.constexpr):
    """out[row] = RMSNorm(x[row]) * ln, rounded once (as `normed_gemv` feeds its GEMV)."""
    row = tl.program_id(0)
    kk = tl.arange(0, BLOCK_K)
    km = kk < width
    xv = tl.load(x_ptr + row * width + kk, mask=km, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xv * xv, 0) / width + eps)
    out = xv * rstd * tl.load(ln_ptr + kk, mask=km, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * width + kk, out.to(out_ptr.dtype.element_ty), mask=km)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, inter, BLOCK: tl.constexpr):
    """out[row] = SiLU(gate) * up of gu[row] = [gate, up] (inter each), rounded as `normed_gemv` (gated) rounds and
    as torch's `F.silu(gate) * up` does (SiLU rounded to the dtype, then the product). Rows on the grid's first axis
    and 64-bit offsets: a prompt batch's rows x width pass 2^31."""
    row, pid = tl.program_id(0).to(tl.int64), tl.program_id(1)
    ty = out_ptr.dtype.element_ty
    n = pid * BLOCK + tl.arange(0, BLOCK)
    nm = n < inter
    g = tl.load(gu_ptr + row * 2 * inter + n, mask=nm, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * inter + inter + n, mask=nm, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * inter + n, ((g / (1.0 + tl.exp(-g))).to(ty).to(tl.float32) * u).to(ty), mask=nm)


TILE = 4096  # weight elements a program loads at once (BLOCK_N rows x a whole input row)


def _blocks(k_in: int) -> tuple[int, int]:
    block_k = triton.next_power_of_2(k_in)
    return max(1, TILE // block_k), block_k


def _warps(block_n: int, block_k: int) -> int:
    return 8 if block_n * block_k > TILE else 4


def normed_gemv(
    x: torch.Tensor, ln: torch.Tensor, eps: float, w: torch.Tensor, bias: torch.Tensor | None, gated: bool
) -> torch.Tensor:
    """w @ RMSNorm(x) (+ bias) for a few rows x [b, width]; gated: SiLU(gate) * up (w = [gate; up])."""
    b, width = x.shape
    n_out = w.shape[0] // 2 if gated else w.shape[0]
    out = torch.empty(b, n_out, dtype=x.dtype, device=x.device)
    block_n, block_k = _blocks(width)
    grid = (triton.cdiv(n_out, block_n), b)
    _normed_gemv_kernel[grid](
        x, ln, w, bias if bias is not None else x, out, width, n_out, eps, HAS_BIAS=bias is not None, GATED=gated,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=_warps(block_n, block_k),
    )  # fmt: skip
    return out


def rms_norm(x: torch.Tensor, ln: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) * ln for rows x [n, width] (one program a row)."""
    n, width = x.shape
    out = torch.empty_like(x)
    block_k = triton.next_power_of_2(width)
    _rms_norm_kernel[(n,)](x, ln, out, width, eps, BLOCK_K=block_k, num_warps=4 if block_k <= 2048 else 8)
    return out


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for rows gu [n, 2 inter] = [gate, up]."""
    n, inter = gu.shape[0], gu.shape[1] // 2
    out = torch.empty(n, inter, dtype=gu.dtype, device=gu.device)
    block = 1024
    _silu_mul_kernel[(n, triton.cdiv(inter, block))](gu, out, inter, BLOCK=block, num_warps=4)
    return out


def rope_write(
    qkv: torch.Tensor,
    p: Any,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    pos: torch.Tensor,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    hq: int,
    hkv: int,
    d: int,
) -> None:
    """Per-head norm and rotary; q into `q`, the key and value into the pool at each row's slot and position."""
    qkn = p.qk_norm if p.qk_norm is not None else qkv
    _rope_write_kernel[(hq + 2 * hkv, qkv.shape[0])](
        qkv, qkn, cos, sin, slots, pos, q, keys, values, keys.shape[2], p.eps_qk,
        HQ=hq, HKV=hkv, D=d, QK_NORM=p.qk_norm is not None,
    )  # fmt: skip


SPLITS = 8  # programs a (head, row) reads its keys with (then merged), per REACH_UNIT positions: one block each
WIDE_SPLITS = 2  # the same for steps of many rows (rows x heads x 2 programs fill the device; a smaller buffer)
REACH_UNIT = 1024  # positions read at those split counts; a longer reach splits its keys as many times more
MAX_SPLITS = 64  # (a power of two: the merge loads a row's partials at once)
MAX_WIDE_SPLITS = 8  # for many rows: their programs fill the device already, and the partials stay small
FILL = 512  # grouped programs (key/value heads x sequences) that fill an H200 alone: keys unsplit, nothing to merge
BLOCK_KEYS = 128
GROUP_ROWS = 16  # least query rows of a matrix product (`_attend_group_kernel` pads a program's rows to it)


def splits_for(rows: int, t: int = 1, hkv: int = 0, reach: int = 0) -> int:
    """Programs a (head, row) reads its keys with, or grouped (hkv > 0) a (key/value head, sequence of t rows): SPLITS
    for a few rows, WIDE_SPLITS for many, one where a round's grouped programs fill the device alone; times the
    REACH_UNITs the rows reach (a long context's keys read by more programs side by side, at most MAX_SPLITS)."""
    if rows > 32 and hkv and t > 1 and rows // t * hkv >= FILL:
        return 1
    units = max(-(-reach // REACH_UNIT), 1)
    if rows <= 32:
        return min(triton.next_power_of_2(SPLITS * units), MAX_SPLITS)
    return min(triton.next_power_of_2(WIDE_SPLITS * units), MAX_WIDE_SPLITS)  # rows x heads fill the device


def attend_partials(
    rows: int, hq: int, d: int, device: torch.device, t: int = 1, hkv: int = 0, reach: int = 0
) -> torch.Tensor:
    """The float32 partials `attend` writes (each split's [acc, max, sum] of each head and row; `splits_for`'s
    arguments), or a stand-in where one split writes the output itself."""
    splits = splits_for(rows, t, hkv, reach)
    return torch.empty(rows if splits > 1 else 1, hq, splits, d + 2, dtype=torch.float32, device=device)


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
    pos: torch.Tensor,
    o: torch.Tensor,
    part: torch.Tensor,
    scale: float,
    hq: int,
    hkv: int,
    d: int,
    pad_slot: int = -1,
    grouped: bool = False,
    t: int = 1,
) -> None:
    """Each (head, row)'s query over its slot's keys 0..pos, into `o`: in splits (into `part`, `attend_partials`),
    then merged. Rows in `pad_slot` (-1: none) read one key. grouped: a program per key/value head and sequence (t
    consecutive rows in one slot: a round's tokens), for all its rows' query heads that share it (the keys read once,
    not once a query head and token)."""
    b, splits = q.shape[0], part.shape[2]
    if grouped:
        g = hq // hkv
        rows = max(GROUP_ROWS, triton.next_power_of_2(t * g))
        half = t > 1 and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)  # rounds (drafts: as measured)
        _attend_group_kernel[(hkv, b // t, splits)](
            q, keys, values, slots, pos, o, part, scale, keys.shape[2], pad_slot, HQ=hq, HKV=hkv, D=d, G=g, T=t,
            RP=rows, BLOCK_N=BLOCK_KEYS // 2, SPLITS=splits, HALF=half, PREC="ieee" if q.dtype == torch.float32 else
            "tf32", num_warps=4 if rows * d <= 4096 else 8,
        )  # fmt: skip
        if splits == 1:
            return
    else:
        _attend_kernel[(hq, b, splits)](
            q, keys, values, slots, pos, part, scale, keys.shape[2], pad_slot, HQ=hq, HKV=hkv, D=d, BLOCK_N=BLOCK_KEYS,
            SPLITS=splits,
        )  # fmt: skip
    _attend_merge_kernel[(hq, b)](part, o, HQ=hq, D=d, SPLITS=splits)


def gemv_residual(a: torch.Tensor, w: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """r + a @ w.T for a few rows a [b, k]."""
    b, k_in = a.shape
    n_out = w.shape[0]
    out = torch.empty_like(r)
    block_n, block_k = _blocks(k_in)
    grid = (triton.cdiv(n_out, block_n), b)
    _gemv_residual_kernel[grid](
        a, w, r, out, n_out, k_in, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=_warps(block_n, block_k)
    )
    return out
