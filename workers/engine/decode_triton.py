"""The Triton kernels of workers/engine/decode_kernels.py and their launches (imported only where Triton runs)."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl


@triton.jit
def _qkv_kernel(
    x_ptr, ln_ptr, w_ptr, b_ptr, qkn_ptr, cos_ptr, sin_ptr, slot_ptr, pos_ptr, q_ptr, k_ptr, v_ptr,
    width, length, eps, eps_qk,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HAS_BIAS: tl.constexpr, QK_NORM: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    head, row = tl.program_id(0), tl.program_id(1)
    ty = x_ptr.dtype.element_ty
    half: tl.constexpr = D // 2
    x_row = x_ptr + row * width
    offs = tl.arange(0, BLOCK_K)
    ss = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, width, BLOCK_K):  # the row's RMS (each program reads the whole row: it is short)
        v = tl.load(x_row + k0 + offs, mask=k0 + offs < width, other=0.0).to(tl.float32)
        ss += v * v
    rstd = 1.0 / tl.sqrt(tl.sum(ss, 0) / width + eps)
    n = tl.arange(0, half)
    acc1 = tl.zeros([half], tl.float32)
    acc2 = tl.zeros([half], tl.float32)
    w1 = w_ptr + (head * D + n)[:, None] * width
    w2 = w_ptr + (head * D + half + n)[:, None] * width
    for k0 in range(0, width, BLOCK_K):
        kk = k0 + offs
        km = kk < width
        xv = tl.load(x_row + kk, mask=km, other=0.0).to(tl.float32)
        xv = (xv * rstd * tl.load(ln_ptr + kk, mask=km, other=0.0).to(tl.float32)).to(ty).to(tl.float32)
        acc1 += tl.sum(tl.load(w1 + kk[None, :], mask=km[None, :], other=0.0).to(tl.float32) * xv[None, :], 1)
        acc2 += tl.sum(tl.load(w2 + kk[None, :], mask=km[None, :], other=0.0).to(tl.float32) * xv[None, :], 1)
    if HAS_BIAS:
        acc1 += tl.load(b_ptr + head * D + n).to(tl.float32)
        acc2 += tl.load(b_ptr + head * D + half + n).to(tl.float32)
    acc1 = acc1.to(ty).to(tl.float32)
    acc2 = acc2.to(ty).to(tl.float32)
    if head < HQ + HKV:  # q or k: Qwen3's per-head norm, then the rotary
        if QK_NORM:
            r = 1.0 / tl.sqrt((tl.sum(acc1 * acc1, 0) + tl.sum(acc2 * acc2, 0)) / D + eps_qk)
            acc1 = (acc1 * r).to(ty).to(tl.float32) * tl.load(qkn_ptr + head * D + n).to(tl.float32)
            acc2 = (acc2 * r).to(ty).to(tl.float32) * tl.load(qkn_ptr + head * D + half + n).to(tl.float32)
        c1 = tl.load(cos_ptr + row * D + n)
        c2 = tl.load(cos_ptr + row * D + half + n)
        s1 = tl.load(sin_ptr + row * D + n)
        s2 = tl.load(sin_ptr + row * D + half + n)
        o1 = acc1 * c1 - acc2 * s1
        o2 = acc2 * c2 + acc1 * s2
    else:
        o1 = acc1
        o2 = acc2
    if head < HQ:
        dst = q_ptr + row * HQ * D + head * D
        tl.store(dst + n, o1.to(ty))
        tl.store(dst + half + n, o2.to(ty))
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
    q_ptr, k_ptr, v_ptr, slot_ptr, pos_ptr, o_ptr, scale, length,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    head, row = tl.program_id(0), tl.program_id(1)
    ty = q_ptr.dtype.element_ty
    kvh = head // (HQ // HKV)
    slot = tl.load(slot_ptr + row)
    n_keys = tl.load(pos_ptr + row) + 1
    d = tl.arange(0, D)
    q = tl.load(q_ptr + row * HQ * D + head * D + d).to(tl.float32) * scale
    base = (slot * HKV + kvh) * length * D
    j0 = tl.arange(0, BLOCK_N)
    m = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), 0)
    total = tl.sum(tl.zeros([BLOCK_N], tl.float32), 0)
    acc = tl.zeros([D], tl.float32)
    for s in range(0, n_keys, BLOCK_N):
        j = s + j0
        jm = j < n_keys
        kt = tl.load(k_ptr + base + j[:, None] * D + d[None, :], mask=jm[:, None], other=0.0).to(tl.float32)
        sc = tl.where(jm, tl.sum(kt * q[None, :], 1), float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, 0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(sc - m_new)
        vt = tl.load(v_ptr + base + j[:, None] * D + d[None, :], mask=jm[:, None], other=0.0).to(tl.float32)
        total = total * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * vt, 0)
        m = m_new
    tl.store(o_ptr + row * HQ * D + head * D + d, (acc / total).to(ty))


@triton.jit
def _gemv_residual_kernel(
    a_ptr, w_ptr, r_ptr, out_ptr, n_out, k_in, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):  # fmt: skip
    """out[row] = r[row] + w @ a[row] (one rounding, as an addmm)."""
    pid, row = tl.program_id(0), tl.program_id(1)
    ty = r_ptr.dtype.element_ty
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < n_out
    offs = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        kk = k0 + offs
        km = kk < k_in
        av = tl.load(a_ptr + row * k_in + kk, mask=km, other=0.0).to(tl.float32)
        wt = tl.load(w_ptr + n[:, None] * k_in + kk[None, :], mask=nm[:, None] & km[None, :], other=0.0)
        acc += tl.sum(wt.to(tl.float32) * av[None, :], 1)
    acc += tl.load(r_ptr + row * n_out + n, mask=nm, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_out + n, acc.to(ty), mask=nm)


@triton.jit
def _gate_up_kernel(
    x_ptr, ln_ptr, w_ptr, out_ptr, width, inter, eps, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):  # fmt: skip
    """out[row] = silu(gate) * up of RMSNorm(x[row]) (gate: w's first `inter` rows, up: the rest)."""
    pid, row = tl.program_id(0), tl.program_id(1)
    ty = x_ptr.dtype.element_ty
    x_row = x_ptr + row * width
    offs = tl.arange(0, BLOCK_K)
    ss = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, width, BLOCK_K):  # the row's RMS (each program reads the whole row: it is short)
        v = tl.load(x_row + k0 + offs, mask=k0 + offs < width, other=0.0).to(tl.float32)
        ss += v * v
    rstd = 1.0 / tl.sqrt(tl.sum(ss, 0) / width + eps)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < inter
    g = tl.zeros([BLOCK_N], tl.float32)
    u = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, width, BLOCK_K):
        kk = k0 + offs
        km = kk < width
        xv = tl.load(x_row + kk, mask=km, other=0.0).to(tl.float32)
        xv = (xv * rstd * tl.load(ln_ptr + kk, mask=km, other=0.0).to(tl.float32)).to(ty).to(tl.float32)
        mask = nm[:, None] & km[None, :]
        wg = tl.load(w_ptr + n[:, None] * width + kk[None, :], mask=mask, other=0.0).to(tl.float32)
        wu = tl.load(w_ptr + (inter + n)[:, None] * width + kk[None, :], mask=mask, other=0.0).to(tl.float32)
        g += tl.sum(wg * xv[None, :], 1)
        u += tl.sum(wu * xv[None, :], 1)
    g = g.to(ty).to(tl.float32)
    u = u.to(ty).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(ty).to(tl.float32)
    tl.store(out_ptr + row * inter + n, (act * u).to(ty), mask=nm)


def _block_k(width: int) -> int:
    return 128 if width >= 128 else triton.next_power_of_2(width)


def qkv(
    x: torch.Tensor,
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
    """Norm, q/k/v, rotary; q into `q`, the key and value into the pool at each row's slot and position."""
    b, width = x.shape
    bias = p.b_qkv if p.b_qkv is not None else x
    qkn = p.qk_norm if p.qk_norm is not None else x
    _qkv_kernel[(hq + 2 * hkv, b)](
        x, p.ln1, p.w_qkv, bias, qkn, cos, sin, slots, pos, q, keys, values,
        width, keys.shape[2], p.eps1, p.eps_qk,
        HQ=hq, HKV=hkv, D=d, HAS_BIAS=p.b_qkv is not None, QK_NORM=p.qk_norm is not None,
        BLOCK_K=max(16, min(_block_k(width), 8192 // d)),
    )  # fmt: skip


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
    pos: torch.Tensor,
    o: torch.Tensor,
    scale: float,
    hq: int,
    hkv: int,
    d: int,
) -> None:
    """Each (head, row)'s query over its slot's keys 0..pos, into `o`."""
    grid = (hq, q.shape[0])
    _attend_kernel[grid](q, keys, values, slots, pos, o, scale, keys.shape[2], HQ=hq, HKV=hkv, D=d, BLOCK_N=64)


def gemv_residual(a: torch.Tensor, w: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """r + a @ w.T for a few rows a [b, k]."""
    b, k_in = a.shape
    n_out = w.shape[0]
    out = torch.empty_like(r)
    block_n = 8 if k_in > 2048 else 16
    grid = (triton.cdiv(n_out, block_n), b)
    _gemv_residual_kernel[grid](a, w, r, out, n_out, k_in, BLOCK_N=block_n, BLOCK_K=_block_k(k_in) * 2)
    return out


def gate_up(x: torch.Tensor, p: Any) -> torch.Tensor:
    """SiLU(gate) * up of the normed rows."""
    b, width = x.shape
    inter = p.w_gate_up.shape[0] // 2
    out = torch.empty(b, inter, dtype=x.dtype, device=x.device)
    block_n = 16
    _gate_up_kernel[(triton.cdiv(inter, block_n), b)](
        x, p.ln2, p.w_gate_up, out, width, inter, p.eps2, BLOCK_N=block_n, BLOCK_K=_block_k(width)
    )
    return out
