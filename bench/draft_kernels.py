"""A drafter's whole greedy drafts with and without its steps as Triton kernels (workers/engine/decode_kernels.py,
`engine.draft_kernels`: GEMV kernels up to MAX_ROWS token rows, cuBLAS GEMMs between kernels up to
`engine.draft_kernel_rows`): the
tokens each proposes, and ms per draft at B sequences, through the engine's real path (static caches, CUDA graphs,
`propose_many`).

    # GPU: the Qwen2.5-0.5B and Qwen3-0.6B shapes (bench/synthetic.py), bf16, K = 8, 256 positions cached
    python -m bench.draft_kernels --device cuda:0 --draft random:qwen2.5-0.5b --draft random:qwen3-0.6b
    # each kernel of a 0.5B layer alone beside cuBLAS; another row limit than decode_kernels.MAX_ROWS
    python -m bench.draft_kernels --parts --b 1;  python -m bench.draft_kernels --max-rows 8 --b 4,6,8
    # batches of drafts (GEMMs between the kernels), and the same with that path off (--wide-rows 0)
    python -m bench.draft_kernels --b 8,16,64,128,256 [--wide-rows 0]

For each drafter, two engines of the same weights (kernels on and off) draft from the same contexts, each call
feeding one new token per sequence as after a rejection: the share of drafts whose tokens are all equal (random
weights: a near-tie can round the other way), then the median ms per call at each B for either.
"""

from __future__ import annotations

import json
import time
from functools import partial
from pathlib import Path

import click
import torch

from bench.stages import sync, time_ms
from bench.synthetic import load_shard
from schemas.requests import SamplingParams
from schemas.settings import Settings
from workers.engine import decode_kernels
from workers.engine.runner import Engine
from workers.speculative.drafters import ModelDrafter, propose_many


class Pair:
    """One drafter preset loaded twice (kernels on, off), sessions prefilled with the same contexts."""

    def __init__(
        self, draft: str, dev: torch.device, dtype: torch.dtype, k: int, ctx: int, bmax: int, rows: int | None = None
    ) -> None:
        self.k, self.ctx = k, ctx
        self.drafters, self.on = [], []
        for kernels in (True, False):
            opts = {"static": True, "max_len": 2048, "graph_k": k, "draft_kernels": kernels}
            settings = Settings(engine=opts if rows is None else {**opts, "draft_kernel_rows": rows})
            shard = load_shard(draft, None, embed=True, head=True, device=str(dev), dtype=dtype)
            engine = Engine(shard, settings, step_tokens=2, pad=False, max_draft=k, slots=bmax, label="draft")
            self.on.append(shard.fused is not None and shard.fused.decode is not None)
            self.drafters.append(ModelDrafter(shard, engine))
        vocab = self.drafters[0].shard.config.vocab_size
        gen = torch.Generator().manual_seed(0)
        self.contexts = [torch.randint(0, vocab, (ctx,), generator=gen).tolist() for _ in range(bmax)]
        self.feed = torch.randint(0, vocab, (4096,), generator=gen).tolist()
        self.sessions = [[d.new_session() for _ in range(bmax)] for d in self.drafters]
        self.ctxs = [[list(c) for c in self.contexts] for _ in self.drafters]
        self.calls = [0, 0]

    def draft(self, which: int, b: int) -> list[list[int]]:
        ctxs = self.ctxs[which]
        for c in ctxs[:b]:
            c.append(self.feed[self.calls[which] % len(self.feed)])
            if len(c) > self.ctx + 64:
                del c[self.ctx :]
        self.calls[which] += 1
        greedy = SamplingParams()
        got = propose_many(self.sessions[which][:b], ctxs[:b], [self.k] * b, [greedy] * b, [None] * b)
        return [d.tokens for d in got]


def graphed_us(fn, reps: int = 50) -> float:
    """Microseconds per call of fn, replayed as one CUDA graph of `reps` calls (launch gaps as in a draft's graph)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / (5 * reps) * 1e6


def parts(dev: torch.device, width: int, inter: int, hq: int, hkv: int, d: int, ctx: int) -> dict[str, float]:
    """Each kernel of one layer alone (µs a call in a graph), beside the cuBLAS GEMM of the same shape."""
    from types import SimpleNamespace

    from workers.engine import decode_triton as k

    bf = dict(device=dev, dtype=torch.bfloat16)
    x, ln = torch.randn(1, width, **bf), torch.ones(width, **bf)
    w_qkv, b_qkv = torch.randn((hq + 2 * hkv) * d, width, **bf) * 0.02, torch.zeros((hq + 2 * hkv) * d, **bf)
    w_o, w_gu, w_dn = (torch.randn(*s, **bf) * 0.02 for s in ((width, hq * d), (2 * inter, width), (width, inter)))
    keys, values = (torch.randn(2, hkv, 2048, d, **bf) for _ in range(2))
    slots, pos = torch.zeros(1, dtype=torch.long, device=dev), torch.full((1,), ctx, dtype=torch.long, device=dev)
    cos, sin = torch.ones(1, d, device=dev), torch.zeros(1, d, device=dev)
    q, o, a = torch.empty(1, hq * d, **bf), torch.randn(1, hq * d, **bf), torch.randn(1, inter, **bf)
    qkv, part = torch.randn(1, (hq + 2 * hkv) * d, **bf), k.attend_partials(1, hq, d, dev)
    p = SimpleNamespace(qk_norm=None, eps_qk=1e-6)
    return {
        "qkv": graphed_us(lambda: k.normed_gemv(x, ln, 1e-6, w_qkv, b_qkv, gated=False)),
        "qkv cuBLAS": graphed_us(lambda: torch.nn.functional.linear(x, w_qkv, b_qkv)),
        "rope_write": graphed_us(lambda: k.rope_write(qkv, p, cos, sin, slots, pos, q, keys, values, hq, hkv, d)),
        "attend": graphed_us(lambda: k.attend(q, keys, values, slots, pos, o, part, 0.1, hq, hkv, d)),
        "o": graphed_us(lambda: k.gemv_residual(o, w_o, x)),
        "o cuBLAS": graphed_us(lambda: torch.addmm(x, o, w_o.t())),
        "gate_up": graphed_us(lambda: k.normed_gemv(x, ln, 1e-6, w_gu, None, gated=True)),
        "gate_up cuBLAS": graphed_us(lambda: torch.mm(x, w_gu.t())),
        "down": graphed_us(lambda: k.gemv_residual(a, w_dn, x)),
        "down cuBLAS": graphed_us(lambda: torch.addmm(x, a, w_dn.t())),
    }


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--device", default="cuda:0", show_default=True)
@click.option("--draft", "drafts", multiple=True, default=["random:qwen2.5-0.5b"], show_default=True)
@click.option("--b", "bs", default="1,2,4", show_default=True)
@click.option("--k", type=int, default=8, show_default=True)
@click.option("--ctx", type=int, default=256, show_default=True)
@click.option("--checks", type=int, default=40, show_default=True, help="Drafts compared at each B.")
@click.option("--iters", type=int, default=30, show_default=True)
@click.option("--max-rows", type=int, default=None, help="decode_kernels.MAX_ROWS for this run (default: as shipped).")
@click.option("--wide-rows", type=int, default=None, help="engine.draft_kernel_rows (default: as shipped).")
@click.option("--parts", "show_parts", is_flag=True, help="Also time each kernel of a 0.5B layer alone.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("bench/out/draft_kernels"))
def main(device: str, drafts: tuple[str, ...], bs: str, k: int, ctx: int, checks: int, iters: int,
         max_rows: int | None, wide_rows: int | None, show_parts: bool, out: Path) -> None:  # fmt: skip
    """Compare and time drafts with the decode kernels on and off (see the module docstring)."""
    dev, sizes = torch.device(device), [int(x) for x in bs.split(",")]
    if max_rows is not None:
        decode_kernels.MAX_ROWS = max_rows
    rows = []
    if show_parts:
        with torch.inference_mode():
            click.echo(json.dumps({n: round(v, 2) for n, v in parts(dev, 896, 4864, 14, 2, 64, ctx).items()}), err=True)
    with torch.inference_mode():
        for draft in drafts:
            t0 = time.perf_counter()
            pair = Pair(draft, dev, torch.bfloat16, k, ctx, max(sizes), wide_rows)
            click.echo(f"{draft}: loaded in {time.perf_counter() - t0:.0f} s, kernels on: {pair.on}", err=True)
            for b in sizes:
                same = sum(pair.draft(0, b) == pair.draft(1, b) for _ in range(checks))
                sync(dev)
                ms = [time_ms(partial(pair.draft, w, b), dev, 3, iters)["ms"] for w in (0, 1)]
                row = {"draft": draft, "b": b, "equal_drafts": f"{same}/{checks}"}
                row.update(kernels_ms=ms[0], fused_ms=ms[1])
                rows.append(row)
                click.echo(json.dumps(row), err=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "draft_kernels.json").write_text(json.dumps({"k": k, "ctx": ctx, "rows": rows}, indent=1))
    click.echo("| drafter | B | equal drafts | kernels ms | fused forward ms |\n|---|---|---|---|---|")
    for r in rows:
        click.echo(f"| {r['draft']} | {r['b']} | {r['equal_drafts']} | {r['kernels_ms']} | {r['fused_ms']} |")


if __name__ == "__main__":
    main()
