"""A drafter's whole greedy drafts with and without its one-token steps as Triton kernels
(workers/engine/decode_kernels.py, `engine.draft_kernels`): the tokens each proposes, and ms per draft at a few
sequences, through the engine's real path (static caches, CUDA graphs, `propose_many`).

    # GPU: the Qwen2.5-0.5B and Qwen3-0.6B shapes (bench/synthetic.py), bf16, K = 8, 256 positions cached
    python -m bench.draft_kernels --device cuda:0 --draft random:qwen2.5-0.5b --draft random:qwen3-0.6b

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
from workers.engine.runner import Engine
from workers.speculative.drafters import ModelDrafter, propose_many


class Pair:
    """One drafter preset loaded twice (kernels on, off), sessions prefilled with the same contexts."""

    def __init__(self, draft: str, dev: torch.device, dtype: torch.dtype, k: int, ctx: int, bmax: int) -> None:
        settings = Settings(engine={"static": True, "max_len": 2048, "graph_k": k})
        self.k, self.ctx = k, ctx
        self.drafters, self.on = [], []
        for kernels in (True, False):
            shard = load_shard(draft, None, embed=True, head=True, device=str(dev), dtype=dtype)
            self.on.append(shard.set_decode_kernels(kernels))
            engine = Engine(shard, settings, step_tokens=2, pad=False, max_draft=k, slots=bmax, label="draft")
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


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--device", default="cuda:0", show_default=True)
@click.option("--draft", "drafts", multiple=True, default=["random:qwen2.5-0.5b"], show_default=True)
@click.option("--b", "bs", default="1,2,4", show_default=True)
@click.option("--k", type=int, default=8, show_default=True)
@click.option("--ctx", type=int, default=256, show_default=True)
@click.option("--checks", type=int, default=40, show_default=True, help="Drafts compared at each B.")
@click.option("--iters", type=int, default=30, show_default=True)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("bench/out/draft_kernels"))
def main(device: str, drafts: tuple[str, ...], bs: str, k: int, ctx: int, checks: int, iters: int, out: Path) -> None:
    """Compare and time drafts with the decode kernels on and off (see the module docstring)."""
    dev, sizes = torch.device(device), [int(x) for x in bs.split(",")]
    rows = []
    with torch.inference_mode():
        for draft in drafts:
            t0 = time.perf_counter()
            pair = Pair(draft, dev, torch.bfloat16, k, ctx, max(sizes))
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
