"""Time the draft model's K-token proposal (graphs, optionally torch.compile'd), alone and batched.

    python -m bench.draft_speed --device cuda:0 --k 8 --batch 1,16 [--compile]

Random Qwen2.5-0.5B-shaped weights in bf16; prints the median ms per proposal of k tokens.
"""

from __future__ import annotations

import statistics
import time

import click
import torch

from bench.synthetic import load_shard
from schemas.settings import Settings
from workers.engine.runner import Engine
from workers.speculative.drafters import ModelDrafter, propose_greedy_many


@click.command()
@click.option("--device", default="cuda:0")
@click.option("--draft", default="random:qwen2.5-0.5b")
@click.option("--k", type=int, default=8)
@click.option("--batch", default="1,16")
@click.option("--compile", "use_compile", is_flag=True)
@click.option("--repeat", type=int, default=20)
def main(device: str, draft: str, k: int, batch: str, use_compile: bool, repeat: int) -> None:
    shard = load_shard(draft, None, embed=True, head=True, device=device, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    engine = Engine(shard, Settings(engine={"max_len": 2048}), step_tokens=2, pad=False, slots=16, compile=use_compile)
    drafter = ModelDrafter(shard, engine)
    for b in (int(x) for x in batch.split(",")):
        sessions = [drafter.new_session() for _ in range(b)]
        contexts = [list(range(100 + i, 228 + i)) for i in range(b)]
        propose_greedy_many(sessions, contexts, [k] * b)  # prefill + capture
        times = []
        for r in range(repeat + 3):
            for c in contexts:
                c.append(7 + r)  # one new committed token each round, as after a rejection
            torch.cuda.synchronize()
            t = time.perf_counter()
            propose_greedy_many(sessions, contexts, [k] * b)
            torch.cuda.synchronize()
            if r >= 3:
                times.append((time.perf_counter() - t) * 1000)
        click.echo(
            f"draft k={k} batch={b} compile={use_compile}: {statistics.median(times):.2f} ms "
            f"(setup+first {time.perf_counter() - t0:.0f}s)"
        )
        for s in sessions:
            s.close()


if __name__ == "__main__":
    main()
