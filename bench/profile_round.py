"""Profile one speculative round's compute stages on a GPU: drafter K steps, head shard, tail shard.

    python -m bench.profile_round --device cuda:0 [--tail-device cuda:1] [--compile-draft] [--out DIR]

For each stage (the real `Engine` path: static caches + CUDA graphs) it prints the median wall time
back to back and after an idle gap like a WAN round trip (`--gap-ms`, default 87), the CUDA kernels
one call launches and their summed device time (torch.profiler), and the top kernels by time. The
head shard also runs through the stock HF layers (`--hf`) to compare with workers/engine/fused.py.
Random Qwen2.5-7B / 0.5B-shaped bf16 weights (`random:` presets). Writes profile.json under --out.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import click
import torch
from torch.profiler import ProfilerActivity, profile

from bench.synthetic import RANDOM_PRESETS, load_shard
from schemas.settings import Settings
from workers.engine.runner import Engine
from workers.speculative.drafters import ModelDrafter, propose_greedy_many
from workers.speculative.verify import verify_greedy


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn: Callable[[], object], dev: torch.device, n: int, gap_s: float) -> float:
    times = []
    for _ in range(n):
        if gap_s:
            time.sleep(gap_s)
        sync(dev)
        t = time.perf_counter()
        fn()
        sync(dev)
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def kernels(fn: Callable[[], object], dev: torch.device, calls: int = 3) -> dict:
    """Kernel count per call, summed device ms per call and the top kernels (name, ms per call, count); on a CPU
    device, every operator with CPU time of its own (views and allocations too) and that time. On CUDA also "ops":
    the operators that launched them, with their input shapes (device ms of their own kernels per call, count;
    empty where a CUDA graph's replay launches them: run with graphs off to see them)."""
    cpu = dev.type == "cpu"
    acts = [ProfilerActivity.CPU] if cpu else [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=acts, record_shapes=not cpu) as prof:
        for _ in range(calls):
            fn()
        sync(dev)
    rows, ops = [], []
    total_us, count = 0.0, 0
    for ev in prof.key_averages():
        dev_us = getattr(ev, "self_device_time_total", 0.0) or getattr(ev, "self_cuda_time_total", 0.0)
        dev_us = ev.self_cpu_time_total if cpu else dev_us
        if (cpu or ev.device_type == torch.autograd.DeviceType.CUDA) and dev_us > 0:
            rows.append((ev.key[:90], dev_us / calls / 1000, ev.count // calls))
            total_us += dev_us
            count += ev.count
    for ev in [] if cpu else prof.key_averages(group_by_input_shape=True):
        dev_us = getattr(ev, "self_device_time_total", 0.0)
        if ev.device_type == torch.autograd.DeviceType.CPU and dev_us > 0 and not ev.key.startswith("cuda"):
            ops.append((f"{ev.key} {str(ev.input_shapes)[:100]}", dev_us / calls / 1000, ev.count // calls))
    rows.sort(key=lambda r: -r[1])
    ops.sort(key=lambda r: -r[1])
    return {"kernels_per_call": count // calls, "device_ms_per_call": total_us / calls / 1000, "top": rows[:12],
            "ops": ops[:16]}  # fmt: skip


def stage(name: str, fn: Callable[[], object], dev: torch.device, gap_ms: float, report: dict) -> None:
    for _ in range(3):
        fn()
    warm = timed(fn, dev, 20, 0.0)
    idle = timed(fn, dev, 10, gap_ms / 1000)
    k = kernels(fn, dev)
    report[name] = {"warm_ms": warm, "after_gap_ms": idle, **k}
    click.echo(
        f"{name}: {warm:.2f} ms warm, {idle:.2f} ms after a {gap_ms:.0f} ms gap; "
        f"{k['kernels_per_call']} kernels, {k['device_ms_per_call']:.2f} ms of kernels"
    )
    for kname, ms, cnt in k["top"]:
        click.echo(f"    {ms:7.3f} ms  x{cnt:<4d} {kname}")


def draft_stage(dshard, k: int, ctx: int, comp: bool) -> Callable[[], object]:
    engine = Engine(
        dshard, Settings(engine={"max_len": 2048}), step_tokens=2, pad=False, slots=16, compile=comp, max_draft=k
    )
    sess = ModelDrafter(dshard, engine).new_session()
    tokens = list(range(100, 100 + ctx))
    propose_greedy_many([sess], [tokens], [k])

    def run() -> None:
        tokens.append(7)  # one new committed token each round, as after a rejection
        if len(tokens) > ctx + 64:
            del tokens[ctx:]
        propose_greedy_many([sess], [tokens], [k])

    return run


def shard_stage(shard, k: int, ctx: int, logits: bool) -> Callable[[], object]:
    dev = shard.device
    engine = Engine(shard, Settings(engine={"max_len": 2048}), step_tokens=k + 1, slots=16)
    cache = engine.acquire()
    if shard.embed is not None:
        prefill, x = torch.arange(ctx, device=dev) % 1000, torch.arange(k + 1, device=dev) + 5
    else:
        width = shard.config.hidden_size
        prefill = torch.randn(ctx, width, device=dev, dtype=shard.dtype)
        x = torch.randn(k + 1, width, device=dev, dtype=shard.dtype)
    engine.forward(cache, prefill, 0)
    drafts = list(range(k))

    def run() -> None:
        cache.crop(ctx)
        out = engine.forward(cache, x, ctx, logits_last=k + 1 if logits else 0)
        if logits:
            verify_greedy(out, drafts)

    return run


@click.command()
@click.option("--device", default="cuda:0")
@click.option("--tail-device", default=None)
@click.option("--target", default="random:qwen2.5-7b")
@click.option("--draft", default="random:qwen2.5-0.5b")
@click.option("--split", type=int, default=14)
@click.option("--k", type=int, default=8)
@click.option("--ctx", type=int, default=256, help="positions already in the caches")
@click.option("--gap-ms", type=float, default=87.0)
@click.option("--compile-draft", is_flag=True, help="also profile the torch.compile'd drafter")
@click.option("--hf/--no-hf", default=True, help="also profile the head shard through the HF layers")
@click.option("--out", type=click.Path(path_type=Path), default=None)
def main(
    device: str,
    tail_device: str | None,
    target: str,
    draft: str,
    split: int,
    k: int,
    ctx: int,
    gap_ms: float,
    compile_draft: bool,
    hf: bool,
    out: Path | None,
) -> None:
    dev, tdev = torch.device(device), torch.device(tail_device or device)
    bf16 = torch.bfloat16
    report: dict = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "k": k, "ctx": ctx}
    n_layers = RANDOM_PRESETS[target.split(":", 1)[1]]["num_hidden_layers"] if target.startswith("random:") else 0
    dshard = load_shard(draft, None, embed=True, head=True, device=device, dtype=bf16)
    stages: list[tuple[str, Callable[[], Callable[[], object]], torch.device]] = [
        ("draft", lambda: draft_stage(dshard, k, ctx, False), dev)
    ]
    if compile_draft:
        stages.append(("draft-compiled", lambda: draft_stage(dshard, k, ctx, True), dev))
    head = load_shard(target, (0, split), embed=True, head=False, device=device, dtype=bf16)
    stages.append(("head", lambda: shard_stage(head, k, ctx, False), dev))
    tail = load_shard(target, (split, n_layers), embed=False, head=True, device=str(tdev), dtype=bf16)
    stages.append(("tail", lambda: shard_stage(tail, k, ctx, True), tdev))
    if hf:
        head_hf = load_shard(target, (0, split), embed=True, head=False, device=device, dtype=bf16, fused=False)
        stages.append(("head-hf-layers", lambda: shard_stage(head_hf, k, ctx, False), dev))
    for name, make, d in stages:
        t0 = time.perf_counter()
        fn = make()
        click.echo(f"  ({name} set up in {time.perf_counter() - t0:.0f} s)")
        stage(name, fn, d, gap_ms, report)
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / "profile.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
