"""What a worker's engines hold on a CUDA device: weights, KV caches and CUDA graphs, and what the slot sizing
(workers/engine/sizing.py) predicted for the graphs. The diagnostic for `--gpu-memory` and `max_slots`.

    python -m bench.graph_memory --target random:qwen2.5-7b --split 14 --draft random:qwen2.5-0.5b --slots 64 \
        [--dtype float16] [--quant 4bit] [--roles tail,head,draft]

Builds the tail's shard (layers split: + norm + LM head), the head's lower shard and the draft model one at a
time, each with an Engine of --slots slots, captures the graphs its worker captures at start (largest batch
first), and prints per capture the memory reserved, then the engine's totals against the measured row cost.
"""

from __future__ import annotations

import gc

import click
import torch

from bench.synthetic import load_shard, preset_of
from workers.engine.graphs import buckets
from workers.engine.runner import Engine
from workers.engine.sizing import attended_lengths, row_bytes

GB = 1e9


def _gb(x: float) -> str:
    return f"{x / GB:.2f} GB"


def report(label: str, engine: Engine, shapes: list[tuple[int, int, int]], row: int) -> None:
    dev = engine.shard.device
    assert engine.pool is not None
    lengths = [n for n in attended_lengths(engine.pool) if n <= engine.capture_len]
    before = torch.cuda.memory_reserved(dev)
    with torch.inference_mode():
        for size in reversed(buckets(engine.pool.slots)):
            for t, p, steps in shapes:
                for n in reversed(lengths):
                    r0 = torch.cuda.memory_reserved(dev)
                    engine._graph(engine.pool, size, t, p, steps, n, log_it=False)
                    grew = torch.cuda.memory_reserved(dev) - r0
                    if grew or size == engine.pool.slots:
                        click.echo(f"  {label}: graph b={size} t={t} p={p} steps={steps} len={n}: +{_gb(grew)}")
    m = engine.memory()
    click.echo(
        f"{label}: {engine.slots} slots; weights {m['weights']:.2f} GB, caches {m['caches']:.2f} GB, graphs "
        f"{_gb(torch.cuda.memory_reserved(dev) - before)} reserved for {len(engine._graphs)} graphs "
        f"(outputs {_gb(engine.graph_memory.output_bytes)}); measured row cost {row / 1e6:.1f} MB x {engine.slots} "
        f"= {_gb(row * engine.slots)}; allocated now {_gb(torch.cuda.memory_allocated(dev))}, reserved "
        f"{_gb(torch.cuda.memory_reserved(dev))}, peak {_gb(torch.cuda.max_memory_allocated(dev))}"
    )


@click.command()
@click.option("--target", default="random:qwen2.5-7b")
@click.option("--draft", default="random:qwen2.5-0.5b")
@click.option("--split", type=int, default=14)
@click.option("--slots", type=int, default=64)
@click.option("--device", default="cuda:0")
@click.option("--k", type=int, default=8)
@click.option("--dtype", "dtype_name", type=click.Choice(["bfloat16", "float16"]), default="bfloat16")
@click.option("--quant", type=click.Choice(["none", "int8", "4bit"]), default="none", help="The target's shards.")
@click.option("--roles", default="tail,head,draft", help="Which engines to build, in order.")
def main(
    target: str, draft: str, split: int, slots: int, device: str, k: int, dtype_name: str, quant: str, roles: str
) -> None:
    """Per engine: captures' memory, and the totals against the row cost the sizing measures."""
    load = dict(device=device, dtype=getattr(torch, dtype_name))
    t = k + 1
    preset = preset_of(target)
    layers = preset["num_hidden_layers"] if preset else 10_000
    names = [r.strip() for r in roles.split(",")]
    if unknown := set(names) - {"tail", "head", "draft"}:
        raise click.BadParameter(f"unknown roles {sorted(unknown)} (tail, head, draft)", param_hint="--roles")
    for role in names:
        if role == "tail":
            shard = load_shard(target, (split, layers), embed=False, head=True, quant=quant, **load)
            engine = Engine(shard, slots=slots, label="tail")
            report("tail", engine, [(t, t, 0), (t, 1, 0)], row_bytes(shard, t, t, engine.pool.index.shape[0]))
        elif role == "head":
            shard = load_shard(target, (0, split), embed=True, head=False, quant=quant, **load)
            engine = Engine(shard, slots=slots, label="head")
            report("head", engine, [(t, 0, 0)], row_bytes(shard, t, 0, engine.pool.index.shape[0]))
        else:
            shard = load_shard(draft, None, embed=True, head=True, **load)
            engine = Engine(shard, slots=slots, step_tokens=2, pad=False, max_draft=k, label="draft")
            report("draft", engine, [(1, 1, k), (2, 1, k)], row_bytes(shard, 2, 2, engine.pool.index.shape[0]))
        del engine, shard
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
