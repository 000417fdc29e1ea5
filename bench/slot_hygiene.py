"""What keeping stale keys/values out of attention costs: zeroing a slot on release, or masking in every round.

    python -m bench.slot_hygiene [--device cpu|cuda] [--dtype float32] [--layers 4] [--heads 28] [--kv-heads 4]
        [--head-dim 128] [--max-len 2048] [--batch 8] [--tokens 9] [--rounds 32] [--reps 20] [--tiny]
        [--graphs-check] [--json OUT]

A masked probability of 0 times a NaN value is NaN, so a slot's stale entries (another sequence's, past this
one's length) must be finite. Two ways to make sure (workers/engine/kvcache.py):
- zero a slot when it is released: `KVPool.clear`, one memset per layer's keys and values, once per sequence;
- mask keys and values as well as scores: `where(valid, keys/values, 0)` over what each attention call reads,
  in every layer of every round.
Per layer shapes default to Qwen2.5-7B's (28 query heads, 4 key/value heads of 128) with fewer layers and a
shorter cache on a CPU (`--layers 28 --max-len 8192 --batch 16 --dtype bfloat16 --device cuda` for the real
thing); `--tiny` adds the tiny test model's shapes and its measured batched round. Printed: ms per release
(and spread over `--rounds` rounds of a sequence), ms per round of the masking (all layers, one batch), and
the round's own attention time beside it.

`--graphs-check` (CUDA) runs a tiny model through an engine with CUDA graphs: a slot filled with NaN past a
sequence's length, released and reused, replays to what a never-used engine gives (and, not cleared, to NaN).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import click
import torch

from schemas.settings import Settings
from workers.engine.fused import attend, score_dtype, wide_gemm_works
from workers.engine.kvcache import KVPool


def timed(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    """Median ms of one call (after one warm-up; CUDA synchronized around each call)."""
    fn()
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1000


def measure(shape: dict, reps: int, device: torch.device, dtype: torch.dtype) -> dict:
    """Release (zero one slot) and per-round masking costs at these shapes."""
    layers, hq, hkv, d = shape["layers"], shape["heads"], shape["kv_heads"], shape["head_dim"]
    b, t, max_len = shape["batch"], shape["tokens"], shape["max_len"]
    pool = KVPool(list(range(layers)), hkv, d, slots=b, max_len=max_len, scratch=t, dtype=dtype, device=device)
    release_ms = timed(lambda: pool.clear(0), reps, device)
    loop_ms = timed(lambda: [x[0].zero_() for x in (*pool.keys.values(), *pool.values.values())], reps, device)
    length = max_len  # a batch attending over its slots' whole length (the longest graphs do)
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(b, t, hq, d, generator=g, device=device).to(dtype)
    k = torch.randn(b, hkv, length, d, generator=g, device=device).to(dtype)
    v = torch.randn(b, hkv, length, d, generator=g, device=device).to(dtype)
    index = torch.arange(length, device=device)
    pos = torch.arange(length - t, length, device=device).expand(b, t)
    mask = (index[None, None, :] <= pos[:, :, None])[:, None]  # [B, 1, T, L], as BatchView builds it
    zero, ninf = torch.zeros((), dtype=score_dtype(q), device=device), torch.tensor(-torch.inf, device=device)
    full = torch.where(mask, zero, ninf.to(zero.dtype))
    bias = full[:, :, None].expand(b, hkv, hq // hkv, t, length).reshape(-1, hq // hkv * t, length)
    valid = (index[None, :] <= pos[:, -1:])[:, None, :, None]  # [B, 1, L, 1]: positions any query may use
    scale = d**-0.5
    wide = device.type == "cuda" and dtype != torch.float32 and wide_gemm_works(device, dtype)  # as FusedLayers

    def plain() -> torch.Tensor:
        return attend(q, k, v, bias, scale, wide)

    def masked() -> torch.Tensor:
        return attend(q, torch.where(valid, k, 0), torch.where(valid, v, 0), bias, scale, wide)

    attend_ms, masked_ms = timed(plain, reps, device), timed(masked, reps, device)
    slot_mb = 2 * layers * hkv * pool.index.shape[0] * d * k.element_size() / 1e6
    return {
        **shape,
        "slot_mb": round(slot_mb, 2),
        "release_ms": release_ms,
        "release_loop_ms": loop_ms,
        "attention_round_ms": attend_ms * layers,
        "masking_round_ms": (masked_ms - attend_ms) * layers,
    }


def tiny_round(reps: int, device: torch.device, batch: int, tokens: int) -> dict:
    """The tiny test model's tail shard: a measured batched round (static engine) and an engine release."""
    from workers.engine.runner import Engine
    from workers.engine.shard import load_shard
    from workers.tiny_models import save_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        target = save_tiny_model(Path(tmp) / "tiny")
        shard = load_shard(target, (2, 4), embed=False, head=True, device=str(device))
    engine = Engine(shard, Settings(engine={"static": True, "max_len": 512}), slots=batch, step_tokens=tokens)
    caches = [engine.acquire() for _ in range(batch)]
    h = shard.config.hidden_size
    with torch.inference_mode():
        engine.forward_many(caches, [torch.randn(64, h, device=device) for _ in caches], [0] * batch, 1)
        xs = [torch.randn(tokens, h, device=device) for _ in caches]

        def one_round() -> None:
            for c in caches:
                c.crop(64)
            engine.forward_many(caches, xs, [64] * batch, tokens)

        round_ms = timed(one_round, reps, device)
    pool = engine.pool
    assert pool is not None
    release_ms = timed(lambda: pool.clear(0), reps, device)
    return {"tiny_round_ms": round_ms, "tiny_release_ms": release_ms, "tiny_slot_mb": _slot_mb(pool)}


def _slot_mb(pool: KVPool) -> float:
    return round(sum(t[0].numel() * t.element_size() for t in (*pool.keys.values(), *pool.values.values())) / 1e6, 3)


def graphs_check(device: str = "cuda") -> str:
    """A poisoned, released and reused slot replays (CUDA graphs) to a fresh engine's logits; unreleased, to NaN.
    (On a CPU the same runs eagerly: a check of the check.)"""
    from workers.engine.runner import Engine
    from workers.engine.shard import load_shard
    from workers.tiny_models import save_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        target = save_tiny_model(Path(tmp) / "tiny")
        shard = load_shard(target, embed=True, head=True, device=device)
    graphs = device.startswith("cuda")

    def run(engine: Engine, cache, prompt: list[int], steps: int) -> torch.Tensor:
        out = [engine.forward_many([cache], [torch.tensor(prompt, device=device)], [0], 1)[0]]
        for i in range(steps):  # one-token rounds: graph replays
            tok = torch.tensor([prompt[i % len(prompt)]], device=device)
            out.append(engine.forward_many([cache], [tok], [len(prompt) + i], 1)[0].clone())
        return torch.cat(out)

    prompt = list(range(3, 23))
    with torch.inference_mode():
        fresh = Engine(
            shard, Settings(engine={"static": True, "graphs": graphs, "max_len": 256}), slots=4, step_tokens=2
        )
        want = run(fresh, fresh.acquire(), prompt, 6)
        engine = Engine(
            shard, Settings(engine={"static": True, "graphs": graphs, "max_len": 256}), slots=4, step_tokens=2
        )
        first = engine.acquire()
        run(engine, first, list(range(40, 140)), 4)
        pool = engine.pool
        assert pool is not None
        for t in (*pool.keys.values(), *pool.values.values()):
            t[first.slot, :, 60:].fill_(float("nan"))  # as a forged or overflowing sequence leaves it
        engine.release(first)
        again = engine.acquire()
        assert again.slot == first.slot
        got = run(engine, again, prompt, 6)
        if not torch.equal(got, want):
            raise AssertionError(f"reused slot differs from a fresh one: max |diff| {float((got - want).abs().max())}")
        engine.release(again)
        for t in (*pool.keys.values(), *pool.values.values()):
            t[first.slot, :, 60:].fill_(float("nan"))
        stale = engine.acquire()  # the poison put back by hand: what release used to leave
        if bool(torch.isfinite(run(engine, stale, prompt, 6)).all()):
            raise AssertionError("NaN past the sequence's length did not reach the output: the check proves nothing")
    return "ok: a reused, zeroed slot replays bit-equal to a fresh engine; an uncleared one gives NaN"


@click.command()
@click.option("--device", default="cpu")
@click.option("--dtype", default="float32")
@click.option("--layers", default=4, help="layers of the shard (Qwen2.5-7B's tail: 14)")
@click.option("--heads", default=28)
@click.option("--kv-heads", default=4)
@click.option("--head-dim", default=128)
@click.option("--max-len", default=2048)
@click.option("--batch", default=8, help="sequences in one batched round")
@click.option("--tokens", default=9, help="tokens per sequence in a round (K + 1)")
@click.option("--rounds", default=32, help="rounds of a sequence, over which one release is spread")
@click.option("--reps", default=20)
@click.option("--tiny", is_flag=True, help="also the tiny test model's shapes and its measured round")
@click.option("--graphs-check", is_flag=True, help="(CUDA) check a reused slot under CUDA graphs")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None)
def main(**o: object) -> None:
    device, dtype = torch.device(str(o["device"])), getattr(torch, str(o["dtype"]))
    keys = ("layers", "heads", "kv_heads", "head_dim", "max_len", "batch", "tokens")
    rows = [measure({k: o[k] for k in keys}, int(o["reps"]), device, dtype)]  # type: ignore[misc]
    if o["tiny"]:
        tiny = {"layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 16, "max_len": 512, "batch": o["batch"]}
        rows.append({**measure({**tiny, "tokens": o["tokens"]}, int(o["reps"]), device, torch.float32)})
        rows[-1].update(tiny_round(int(o["reps"]), device, int(o["batch"]), int(o["tokens"])))  # type: ignore[arg-type]
    for r in rows:
        spread = r["release_ms"] / int(o["rounds"])  # type: ignore[call-overload]  # one sequence's share
        r["release_per_round_ms"] = spread * int(r["batch"])  # a batched round's sequences' shares
        print(
            f"{r['layers']} layers x kv {r['kv_heads']}x{r['head_dim']}, {r['max_len']} positions ({r['slot_mb']} MB "
            f"a slot), batch {r['batch']} x {r['tokens']} tokens on {device} {o['dtype']}:\n"
            f"  zero on release: {r['release_ms']:.3f} ms per release (per-tensor loop {r['release_loop_ms']:.3f}),"
            f" {spread:.4f} ms per round of a {o['rounds']}-round sequence, x{r['batch']} sequences"
            f" = {r['release_per_round_ms']:.4f} ms per batched round\n"
            f"  mask keys/values: {r['masking_round_ms']:.3f} ms per batched round (attention itself"
            f" {r['attention_round_ms']:.3f} ms)"
        )
        if "tiny_round_ms" in r:
            print(f"  tiny tail round (measured, {r['batch']} sequences): {r['tiny_round_ms']:.3f} ms")
    if o["graphs_check"]:
        rows.append({"graphs_check": graphs_check(str(device))})
        print("graphs check:", rows[-1]["graphs_check"])
    if o["json_out"]:
        Path(str(o["json_out"])).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
