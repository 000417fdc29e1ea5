"""A drafter's steps of a few tokens as six Triton kernels a layer: a draft step at one sequence is launch-bound.

On an H200 a 0.5B drafter's step ran about 17 kernels a layer in the fused forward (workers/engine/fused.py: norms,
GEMMs of one row, rotary, key/value writes, attention, activation), about 1.5 ms a step for 24 layers against a
weight read of 0.25 ms. For steps of a few token rows (sequences x tokens, at most MAX_ROWS: a lone job's
whole draft, its first step feeding the verdict's tokens included) over a pool that attention reads in place, each
layer here is (workers/engine/decode_triton.py; each GEMV program loads its weight rows whole, all loads in flight):

1. `normed_gemv`: RMSNorm and the q/k/v GEMV (+ bias);
2. `rope_write`: Qwen3's per-head q/k norm, rotary, and the new key and value written into the pool at each row's
   slot and position;
3. `attend`: one query row per (head, row) over its slot's keys up to its position, softmax in float32;
4. `gemv_residual`: the output projection added to the residual stream;
5. `normed_gemv` (gated): RMSNorm, gate and up GEMVs and SiLU(gate) * up;
6. `gemv_residual`: the down projection added to the residual stream.

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
from dataclasses import dataclass
from typing import Any

import torch

from workers.engine.kvcache import BatchView, KVPool

MAX_ROWS = 4  # token rows (sequences x tokens, padding included) of a step run here: a lone job's drafts
MAX_REACH = 1024  # positions a row may attend over: 8 splits of at most 128 keys (longer: split-KV flash)
AGREE = 0.2  # the load check's largest relative (L2) difference between a step's logits through the kernels and fused
MAX_WIDTH = 16384  # the widest input row a GEMV program loads whole (hidden size, intermediate size, q heads x dim)
log = logging.getLogger("shardflow.engine")


def available(device: torch.device) -> bool:
    """Whether the kernels can run on `device`: Triton installed, and CUDA (or the interpreter, on the CPU)."""
    if importlib.util.find_spec("triton") is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _on(device: torch.device) -> contextlib.AbstractContextManager:
    """Triton launches on the current CUDA device: a drafter on another GPU (--draft-device) makes its own current."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def agrees(shard: Any, decode: DecodeLayers) -> bool:
    """One draft step through the kernels against the fused forward, on the shard's own layers over a scratch pool
    (so every kernel variant it will run is built now, at load): a build or launch failure (a machine whose Triton
    has no C compiler, say), a non-finite result or a disagreement keeps the kernels off, with a warning."""
    fused, dev = shard.fused, shard.device
    try:
        with _on(dev), torch.inference_mode():
            ids = torch.randint(0, shard.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0)).to(dev)
            pos, rows = torch.arange(9, device=dev)[None], torch.zeros(1, dtype=torch.long, device=dev)
            outs = []
            for kernels in (None, decode):
                pool = KVPool.for_shard(shard, slots=1, max_len=32, scratch=8)
                fused.decode = None
                shard.run_batch(ids[:, :8], pos[:, :8], BatchView(pool, rows, pos[:, :8]))
                fused.decode = kernels
                outs.append(shard.run_batch(ids[:, 8:], pos[:, 8:], BatchView(pool, rows, pos[:, 8:])).float())
            want, got = outs
            # half-precision roundings part two right implementations by a few percent over a few layers (float32:
            # 1e-6); a wrong index or a broken build by about the logits' own size
            ok = bool(torch.isfinite(got).all()) and float((got - want).norm() / want.norm().clamp_min(1e-6)) <= AGREE
    except Exception as e:  # anything Triton's toolchain or a launch raises
        log.warning("draft kernels off on %s: %s: %s", dev, type(e).__name__, e)
        return False
    finally:
        fused.decode = None
    if not ok:
        log.warning("draft kernels off on %s: a step through them does not agree with the fused forward", dev)
    return ok


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
    """A fused stack's layers run as the kernels above, for steps of at most MAX_ROWS token rows."""

    def __init__(self, layers: list[DecodeLayer], heads: int, kv_heads: int, head_dim: int, scale: float) -> None:
        self.layers, self.heads, self.kv_heads, self.head_dim, self.scale = layers, heads, kv_heads, head_dim, scale

    @classmethod
    def for_layers(cls, fused: Any) -> DecodeLayers | None:
        """The stack (workers/engine/fused.py's FusedLayers) as decode layers, or None where one layer does not
        qualify."""
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
        return cls(out, fused.heads, fused.kv_heads, d, fused.scale)

    def applies(self, pool: Any, b: int, t: int, reach: int, cos: torch.Tensor) -> bool:
        """Whether a step of b rows x t tokens reaching `reach` positions over `pool` runs here (a pool's tensors are
        contiguous as KVPool makes them)."""
        return b * t <= MAX_ROWS and reach <= MAX_REACH and not pool.rings and cos.shape[-1] == self.head_dim

    def __call__(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pool: Any, slots: torch.Tensor, last: torch.Tensor
    ) -> torch.Tensor:
        """h [B, T, width] through every layer; cos/sin [B, T, d]; slots [B]; last [B]: each row's slot and its last
        token's position. A row's T tokens sit at consecutive positions and run as T rows of one token: each key and
        value is written at its slot and position before any attends, and each token attends over positions 0 to
        its own of its slot (causal within the step)."""
        with _on(h.device):
            return self._run(_kernels(), h, cos, sin, pool, slots, last)

    def _run(
        self, k: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pool: Any, slots: torch.Tensor,
        last: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        b, t, width = h.shape
        hq, hkv, d = self.heads, self.kv_heads, self.head_dim
        n = b * t
        x = h.reshape(n, width).contiguous()
        cos, sin = cos.reshape(n, d).float().contiguous(), sin.reshape(n, d).float().contiguous()
        pos = (last.reshape(b, 1) - (t - 1) + torch.arange(t, device=last.device)).reshape(n).contiguous()
        slots = slots.reshape(b).repeat_interleave(t) if t > 1 else slots.reshape(b).contiguous()
        q = torch.empty(n, hq * d, dtype=h.dtype, device=h.device)
        o = torch.empty_like(q)
        pad = pool.padding if pool.padding is not None else -1  # its rows read one key
        part = k.attend_partials(n, hq, d, h.device)  # one buffer for every layer's attention splits
        for p in self.layers:
            keys, values = pool.keys[p.idx], pool.values[p.idx]
            qkv = k.normed_gemv(x, p.ln1, p.eps1, p.w_qkv, p.b_qkv, gated=False)
            k.rope_write(qkv, p, cos, sin, slots, pos, q, keys, values, hq, hkv, d)
            k.attend(q, keys, values, slots, pos, o, part, self.scale, hq, hkv, d, pad)
            x = k.gemv_residual(o, p.w_o, x)
            a = k.normed_gemv(x, p.ln2, p.eps2, p.w_gate_up, None, gated=True)
            x = k.gemv_residual(a, p.w_down, x)
        return x.view(b, t, width)
