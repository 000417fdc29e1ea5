"""A drafter's steps as a few Triton kernels a layer (the fused forward runs about 17): a draft step is launch-bound.

On an H200 a 0.5B drafter's step ran about 17 kernels a layer in the fused forward (workers/engine/fused.py: norms,
GEMMs, rotary, key/value writes, attention, activation), about 1.5 ms a step for 24 layers against a weight read of
0.25 ms. Over a pool that attention reads in place, a step of at most MAX_ROWS token rows (sequences x tokens,
padding included: a lone job's whole draft, its first step feeding the verdict's tokens too) runs each layer as six
kernels (workers/engine/decode_triton.py; each GEMV program loads its weight rows whole, all loads in flight):

1. `normed_gemv`: RMSNorm and the q/k/v GEMV (+ bias);
2. `rope_write`: Qwen3's per-head q/k norm, rotary, and the new key and value written into the pool at each row's
   slot and position;
3. `attend`: one query row per (head, row) over its slot's keys up to its position, in splits merged by their
   maxima, softmax in float32;
4. `gemv_residual`: the output projection added to the residual stream;
5. `normed_gemv` (gated): RMSNorm, gate and up GEMVs and SiLU(gate) * up;
6. `gemv_residual`: the down projection added to the residual stream.

A step of more rows, up to `EngineSettings.draft_kernel_rows` (a batch of jobs' drafts), runs the GEMMs through
cuBLAS instead: `rms_norm`, q/k/v GEMM, `rope_write`, `attend`, output GEMM + residual, `rms_norm`, gate/up GEMM,
`silu_mul`, down GEMM + residual: 10 kernels a layer.

Numerics follow the fused forward's roundings (half-precision GEMM outputs, float32 accumulation and softmax) but not
bit for bit: only drafters run this, and a draft's rounding can change which tokens are proposed, never the output
(the target verifies every token). `DecodeLayers.for_layers` says whether a stack qualifies (Llama/Qwen2/Mistral/
Qwen3 layouts, SiLU, full-width rotary, no windows, sinks, experts or quantized linears); `available()` whether Triton
runs here (CUDA; tests run the kernels on the CPU through Triton's interpreter, TRITON_INTERPRET=1); `agrees()`, at
load, whether one step through them on the shard's own layers agrees with the fused forward.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from schemas.settings import EngineSettings
from workers.engine import pool_attention
from workers.engine.kvcache import BatchView, KVPool

MAX_ROWS = 4  # token rows (sequences x tokens, padding included) of a step run with GEMV kernels: a lone job's drafts
MAX_REACH = 1 << 17  # positions a row may attend over (its keys split by more programs the longer it reaches)
AGREE = 0.2  # the load check's largest relative (L2) difference between a step's logits through the kernels and fused
ROUND_TOKENS = 16  # tokens a row of a step attend in one program at most (a round's; longer steps: a program each)
MAX_WIDTH = 16384  # the widest input row a GEMV program loads whole (hidden size, intermediate size, q heads x dim)
log = logging.getLogger("shardflow.engine")
# (q, first, lse, (new keys, new values), scale) -> out: `pool_attention.merge_later`'s work, as merge_triton runs it
Pair = tuple[torch.Tensor, torch.Tensor]
MergeLater = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Pair, float], torch.Tensor]


def available(device: torch.device) -> bool:
    """Whether the kernels can run on `device`: Triton installed, and CUDA (or the interpreter, on the CPU)."""
    if importlib.util.find_spec("triton") is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def wanted(engine: EngineSettings, drafter: bool, compile: bool) -> tuple[bool, int]:
    """(on, rows) for `Shard.set_decode_kernels` from EngineSettings `engine`: a drafter's steps up to
    draft_kernel_rows (off with draft_kernels off or a compiled drafter), a target's rounds up to target_kernel_rows."""
    if not drafter:
        return engine.target_kernel_rows > 0, engine.target_kernel_rows
    return engine.draft_kernels and not compile and engine.draft_kernel_rows > 0, engine.draft_kernel_rows


def _on(device: torch.device) -> contextlib.AbstractContextManager:
    """Triton launches on the current CUDA device: a drafter on another GPU (--draft-device) makes its own current."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def agrees(shard: Any, decode: DecodeLayers) -> bool:
    """Draft steps through the kernels against the fused forward, on the shard's own layers over a scratch pool (so
    every kernel variant it will run is built now, at load): one row of one token (GEMVs), then two rows of three
    (GEMMs between the kernels). A build or launch failure (a machine whose Triton has no C compiler, say), a
    non-finite result or a disagreement keeps the kernels off, with a warning."""
    fused, dev = shard.fused, shard.device
    try:
        with _on(dev), torch.inference_mode():
            gen = torch.Generator().manual_seed(0)
            ids = torch.randint(0, shard.config.vocab_size, (2, 12), generator=gen).to(dev)
            if shard.embed is None:  # a tail: hidden states of the embeddings' size in
                ids = torch.randn(2, 12, shard.config.hidden_size, generator=gen).to(dev, shard.dtype)
            pos = torch.arange(12, device=dev).repeat(2, 1)
            rows = torch.arange(2, device=dev)
            wide = torch.tensor([[9, 10, 11], [8, 9, 10]], device=dev)  # row 1 goes on from its prefill's end
            steps = ((rows[:1], pos[:1, 8:9].contiguous()), (rows, wide))
            outs: list[list[torch.Tensor]] = []
            for kernels in (None, decode):
                pool = KVPool.for_shard(shard, slots=2, max_len=32, scratch=8)
                fused.decode = None
                shard.run_batch(ids[:, :8].contiguous(), pos[:, :8], BatchView(pool, rows, pos[:, :8]))
                fused.decode = kernels
                outs.append([shard.run_batch(ids[r[:, None], p], p, BatchView(pool, r, p)).float() for r, p in steps])
            # half-precision roundings part two right implementations by a few percent over a few layers (float32:
            # 1e-6); a wrong index or a broken build by about the logits' own size
            ok = all(
                bool(torch.isfinite(got).all()) and float((got - want).norm() / want.norm().clamp_min(1e-6)) <= AGREE
                for want, got in zip(*outs, strict=True)
            )
    except Exception as e:  # anything Triton's toolchain or a launch raises
        log.warning("draft kernels off on %s: %s: %s", dev, type(e).__name__, e)
        return False
    finally:
        fused.decode = None
    if not ok:
        log.warning("draft kernels off on %s: a step through them does not agree with the fused forward", dev)
    return ok


def silu_mul_kernel(
    device: torch.device, dtype: torch.dtype, inter: int
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """SiLU(gate) * up as one Triton kernel over rows [gate, up] of `inter` each (`decode_triton.silu_mul`), built
    now (so no capture builds it) where it runs on a CUDA device in half precision; else, or if it does not build,
    None: torch's two elementwise kernels over the strided halves took 2 x 57 us a 7B layer at 128 sequences'
    rounds on an H100 (docs/runs/journal.md, run 120)."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16) or inter < 1 or not available(device):
        return None
    try:
        with _on(device):
            _kernels().silu_mul(torch.zeros(1, 2 * inter, dtype=dtype, device=device))
    except Exception as e:  # a Triton that cannot build here: torch's kernels
        log.warning("SiLU kernel off on %s (%s: %s)", device, type(e).__name__, e)
        return None
    return _kernels().silu_mul


def merge_kernel(device: torch.device, dtype: torch.dtype, head_dim: int) -> MergeLater | None:
    """`pool_attention.merge_later` as one Triton kernel (`merge_triton.merge_later`) where it runs on a CUDA device in
    half precision for this head width, built now (so no capture builds it) and checked against torch's merge on
    random rows; else, or if it does not build or agree, None: torch's ten kernels a layer over float32 copies (1.3 ms
    of a 7B head's 15.7 at 128 sequences, run 122)."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16) or not available(device):
        return None
    try:
        from workers.engine import merge_triton

        if not merge_triton.fits(head_dim, ROUND_TOKENS):
            return None
        with _on(device), torch.inference_mode():
            ok = _merge_agrees(merge_triton.merge_later, device, dtype, head_dim)
    except Exception as e:  # a Triton that cannot build here: torch's kernels
        log.warning("attention merge kernel off on %s (%s: %s)", device, type(e).__name__, e)
        return None
    if not ok:
        log.warning("attention merge kernel off on %s: it does not agree with torch's merge", device)
    return merge_triton.merge_later if ok else None


def _merge_agrees(merge: MergeLater, device: torch.device, dtype: torch.dtype, d: int) -> bool:
    """Rounds of 9 tokens, 3 sequences x 2 key/value heads of 5 query heads, strided keys as a fused layer's: the
    kernel's merge within half-precision rounding of torch's (a wrong index: about the values' own size)."""
    gen = torch.Generator().manual_seed(0)
    t, g, hkv, b = 9, 5, 2, 3
    q, first = (torch.randn(b * hkv, t * g, d, generator=gen).to(device, dtype) for _ in range(2))
    lse = (torch.randn(b * hkv, t * g, generator=gen) * 3).to(device)
    qkv = torch.randn(b, t, 3 * hkv, d, generator=gen).to(device, dtype)
    new = (qkv[:, :, hkv : 2 * hkv].transpose(1, 2), qkv[:, :, 2 * hkv :].transpose(1, 2))
    want = pool_attention.merge_later(q, first, lse, new, pool_attention.later_bias(t, g, device), d**-0.5).float()
    got = merge(q, first, lse, new, d**-0.5).float()
    return bool(torch.isfinite(got).all()) and float((got - want).norm() / want.norm()) <= 1e-2


def _kernels() -> Any:
    """The Triton kernels, defined at first use (Triton is imported only where it runs)."""
    global _K
    if _K is None:
        from workers.engine import decode_triton

        _K = decode_triton
    return _K


_K: Any = None


@dataclass
class DecodeLayer:
    """One layer's weights as the kernels read them (views of the fused layer's)."""

    w_qkv: torch.Tensor  # [(hq + 2 hkv) d, width]
    b_qkv: torch.Tensor | None
    w_o: torch.Tensor  # [width, hq d]
    w_gate_up: torch.Tensor  # [2 inter, width]
    w_down: torch.Tensor  # [width, inter]
    idx: int
    ln1: torch.Tensor
    eps1: float
    ln2: torch.Tensor
    eps2: float
    qk_norm: torch.Tensor | None  # [hq + hkv, d] (Qwen3)
    eps_qk: float


def _joined(parts: list) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """A fused layer's linears (one concatenated (weight, bias), or several apart: a CPU load's) as one, or None for
    quantized ones."""
    if not parts or not all(isinstance(p, tuple) for p in parts):
        return None
    if len(parts) == 1:
        return parts[0]
    biases = [b for _, b in parts]
    bias = torch.cat(biases) if all(b is not None for b in biases) else None  # type: ignore[arg-type]
    return torch.cat([w for w, _ in parts]), bias


class DecodeLayers:
    """A fused stack's layers run as the kernels above, for steps of at most `rows` token rows."""

    def __init__(
        self, layers: list[DecodeLayer], heads: int, kv_heads: int, head_dim: int, scale: float, rows: int
    ) -> None:
        self.layers, self.heads, self.kv_heads, self.head_dim, self.scale = layers, heads, kv_heads, head_dim, scale
        self.rows = rows  # most token rows of a step run here (GEMVs up to MAX_ROWS, GEMMs between kernels past it)

    @classmethod
    def for_layers(cls, fused: Any, rows: int) -> DecodeLayers | None:
        """The stack (workers/engine/fused.py's FusedLayers) as decode layers for steps of up to `rows` token rows, or
        None where one layer does not qualify."""
        d = fused.head_dim
        if d & (d - 1) or d < 16 or fused.heads % fused.kv_heads:
            return None
        out = []
        for p in fused.layers:
            qkv, gate_up = _joined(p.qkv), _joined(p.gate_up)
            plain = qkv is not None and gate_up is not None
            plain = plain and isinstance(p.w_o, torch.Tensor) and isinstance(p.w_down, torch.Tensor)
            special = p.b_o is not None or p.post_attn is not None or p.post_mlp is not None or p.moe is not None
            if not plain or special or p.sinks is not None or p.act != "silu":
                return None
            assert qkv is not None and gate_up is not None
            (w_qkv, b_qkv), (w_gu, _) = qkv, gate_up
            if not all(t.is_contiguous() for t in (w_qkv, w_gu, p.w_o, p.w_down, p.ln1, p.ln2)):
                return None
            if max(w_qkv.shape[1], p.w_o.shape[1], p.w_down.shape[1]) > MAX_WIDTH:
                return None
            norms = (p.ln1, p.eps1, p.ln2, p.eps2, p.qk_norm, p.eps_qk)
            out.append(DecodeLayer(w_qkv, b_qkv, p.w_o, w_gu, p.w_down, p.idx, *norms))
        return cls(out, fused.heads, fused.kv_heads, d, fused.scale, rows)

    def applies(self, pool: Any, b: int, t: int, reach: int, cos: torch.Tensor) -> bool:
        """Whether a step of b rows x t tokens reaching `reach` positions over `pool` runs here (a pool's tensors are
        contiguous as KVPool makes them)."""
        return b * t <= self.rows and reach <= MAX_REACH and not pool.rings and cos.shape[-1] == self.head_dim

    def __call__(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pool: Any, slots: torch.Tensor, last: torch.Tensor,
        reach: int = 0,
    ) -> torch.Tensor:  # fmt: skip
        """h [B, T, width] through every layer; cos/sin [B, T, d]; slots [B]; last [B]: each row's slot and its last
        token's position; `reach`: positions no row attends past (its keys are split by more programs the longer it
        is). A row's T tokens sit at consecutive positions and run as T rows of one token: each key and value is
        written at its slot and position before any attends, and each token attends over positions 0 to its own of
        its slot (causal within the step)."""
        with _on(h.device):
            return self._run(_kernels(), h, cos, sin, pool, slots, last, reach)

    def _run(
        self, k: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pool: Any, slots: torch.Tensor,
        last: torch.Tensor, reach: int,
    ) -> torch.Tensor:  # fmt: skip
        b, t, width = h.shape
        hq, hkv, d = self.heads, self.kv_heads, self.head_dim
        n = b * t
        ops = _Gemv(k) if n <= MAX_ROWS else _Gemm(k)
        x = ops.stream(h.reshape(n, width))
        cos, sin = cos.reshape(n, d).float().contiguous(), sin.reshape(n, d).float().contiguous()
        pos = (last.reshape(b, 1) - (t - 1) + torch.arange(t, device=last.device)).reshape(n).contiguous()
        slots = slots.reshape(b).repeat_interleave(t) if t > 1 else slots.reshape(b).contiguous()
        q = torch.empty(n, hq * d, dtype=h.dtype, device=h.device)
        o = torch.empty_like(q)
        pad = pool.padding if pool.padding is not None else -1  # its rows read one key
        # a program a key/value head and sequence (its t tokens; a long step's tokens apart: a program's rows)
        grouped = ((t if t <= ROUND_TOKENS else 1), hkv) if ops.grouped else (1, 0)
        part = k.attend_partials(n, hq, d, h.device, *grouped, reach)  # one buffer for every layer's attention splits
        for p in self.layers:
            keys, values = pool.keys[p.idx], pool.values[p.idx]
            qkv = ops.normed(x, p.ln1, p.eps1, p.w_qkv, p.b_qkv)
            k.rope_write(qkv, p, cos, sin, slots, pos, q, keys, values, hq, hkv, d)
            k.attend(q, keys, values, slots, pos, o, part, self.scale, hq, hkv, d, pad, ops.grouped, grouped[0])
            x = ops.residual(o, p.w_o, x)
            x = ops.residual(ops.gated(x, p.ln2, p.eps2, p.w_gate_up), p.w_down, x)
        return x.view(b, t, width)


class _Gemv:
    """A step of a few rows: RMSNorm fused into GEMV programs that each load whole weight rows."""

    grouped = False  # attention: a program a query head (few rows: more programs to fill the device)

    def __init__(self, k: Any) -> None:
        self.k = k

    def stream(self, h: torch.Tensor) -> torch.Tensor:
        """The step's residual stream [rows, width] from its input."""
        return h.contiguous()

    def normed(self, x: torch.Tensor, ln: torch.Tensor, eps: float, w: torch.Tensor, bias: Any) -> torch.Tensor:
        return self.k.normed_gemv(x, ln, eps, w, bias, gated=False)

    def gated(self, x: torch.Tensor, ln: torch.Tensor, eps: float, w: torch.Tensor) -> torch.Tensor:
        return self.k.normed_gemv(x, ln, eps, w, None, gated=True)

    def residual(self, a: torch.Tensor, w: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return self.k.gemv_residual(a, w, r)


class _Gemm(_Gemv):
    """A step of many rows: cuBLAS GEMMs, a norm kernel before each and SiLU * up after gate/up (10 kernels a layer,
    where the fused forward runs about 17)."""

    grouped = True  # attention: a program a key/value head, its keys read once for every query head sharing them

    def stream(self, h: torch.Tensor) -> torch.Tensor:
        return h.clone(memory_format=torch.contiguous_format)  # the residual adds update it in place

    def normed(self, x: torch.Tensor, ln: torch.Tensor, eps: float, w: torch.Tensor, bias: Any) -> torch.Tensor:
        xn = self.k.rms_norm(x, ln, eps)
        return torch.mm(xn, w.t()) if bias is None else torch.addmm(bias, xn, w.t())

    def gated(self, x: torch.Tensor, ln: torch.Tensor, eps: float, w: torch.Tensor) -> torch.Tensor:
        return self.k.silu_mul(torch.mm(self.k.rms_norm(x, ln, eps), w.t()))

    def residual(self, a: torch.Tensor, w: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return r.addmm_(a, w.t())  # in place: the stream is the step's own copy (`_run`), no copy a layer
