"""Attention kernels side by side for the shapes a round runs, each captured in a CUDA graph (24 calls per
replay, as a drafter step's layers run them back to back) so launch costs count as they do in the engine:

    python -m bench.attn_variants --out $OUT/attn      # one GPU; prints a table, writes attn.json

Variants, all float32 softmax over a bf16 cache of L positions with an additive mask (each row sees a
prefix), grouped-query heads folded into the query rows as workers/engine/fused.py does:
- `fused`: workers/engine/fused.py `attend` (half GEMM with float32 output, softmax, cast, GEMM: what runs today);
- `sdpa-efficient` / `sdpa-cudnn`: torch's scaled_dot_product_attention with that backend forced (one kernel);
- `sdpa-default`: torch's own choice.
Shapes: the 0.5B drafter (14 query / 2 key-value heads of 64) at one token a row, and the 7B halves (28 / 4 of
128) at 9 tokens a row, B in {1, 16, 64, 128}. Max abs difference to `fused` is reported beside the time.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import click
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

from workers.engine.fused import attend, wide_gemm_works

CALLS = 24


def _inputs(b: int, t: int, hq: int, hkv: int, d: int, length: int, ctx: int, dev: torch.device):
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(b, t, hq, d, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(b, hkv, length, d, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(b, hkv, length, d, device=dev, dtype=torch.bfloat16, generator=g)
    pos = ctx + torch.arange(t, device=dev)[None].expand(b, t)
    mask = (torch.arange(length, device=dev)[None, None] <= pos[:, :, None])[:, None]  # [B, 1, T, L]
    bias = torch.where(mask, 0.0, -torch.inf).to(torch.float32)
    return q, k, v, bias


def _fused(q, k, v, bias, wide):
    b, t, hq, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    g = hq // hkv
    full = bias[:, :, None].expand(b, hkv, g, t, length).reshape(-1, g * t, length)
    return attend(q, k, v, full, d**-0.5, wide)


def _sdpa(q, k, v, bias):
    b, t, hq, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    g = hq // hkv
    q4 = q.reshape(b, t, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * t, d)
    m = bias.to(q.dtype)[:, :, None].expand(b, 1, g, t, length).reshape(b, 1, g * t, length)
    out = sdpa(q4, k, v, attn_mask=m, scale=d**-0.5)
    return out.view(b, hkv, g, t, d).permute(0, 3, 1, 2, 4).reshape(b * t, hq * d)


def _time(fn, dev: torch.device) -> float:
    """ms per call: CALLS calls captured in one graph, replayed."""
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(dev).wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        for _ in range(CALLS):
            out = fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize(dev)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    reps = 20
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize(dev)
    del out
    return start.elapsed_time(end) / reps / CALLS


@click.command()
@click.option("--device", default="cuda:0")
@click.option("--length", type=int, default=512, show_default=True, help="Attended positions (a graph bucket).")
@click.option("--ctx", type=int, default=256, show_default=True, help="Positions each row sees before its own.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("bench/out/attn"))
def main(device: str, length: int, ctx: int, out: Path) -> None:
    dev = torch.device(device)
    wide = wide_gemm_works(dev, torch.bfloat16)
    rows = []
    shapes = [("drafter 0.5B", 1, 14, 2, 64), ("7B half", 9, 28, 4, 128)]
    for name, t, hq, hkv, d in shapes:
        for b in (1, 16, 64, 128):
            q, k, v, bias = _inputs(b, t, hq, hkv, d, length, ctx, dev)
            ref = _fused(q, k, v, bias, wide).float()
            row = {"shape": name, "B": b, "T": t}
            fused, viaspda = partial(_fused, q, k, v, bias, wide), partial(_sdpa, q, k, v, bias)
            variants = {
                "fused": (fused, None),
                "sdpa-default": (viaspda, None),
                "sdpa-efficient": (viaspda, SDPBackend.EFFICIENT_ATTENTION),
                "sdpa-cudnn": (viaspda, SDPBackend.CUDNN_ATTENTION),
            }
            for vname, (fn, backend) in variants.items():
                try:
                    if backend is None:
                        diff = (fn().float() - ref).abs().max().item()
                        ms = _time(fn, dev)
                    else:
                        with sdpa_kernel(backend):
                            diff = (fn().float() - ref).abs().max().item()
                            ms = _time(fn, dev)
                    row[vname] = {"ms": round(ms, 4), "max_diff": diff}
                except Exception as e:  # a backend that does not take these shapes
                    row[vname] = {"error": str(e).splitlines()[0][:120]}
            rows.append(row)
            cells = [
                f"{n} {r['ms'] * 1000:.1f} us (diff {r['max_diff']:.1e})" if "ms" in r else f"{n}: {r['error'][:60]}"
                for n, r in ((n, row[n]) for n in variants)
            ]
            print(f"{name} B={b} T={t}: " + "; ".join(cells), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attn.json").write_text(json.dumps({"length": length, "ctx": ctx, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
