"""CPU benchmark of one split speculative generation path with tiny (or given) models.

    python -m bench.cpu_round [--target DIR --split N --draft DIR] [--new 64] [--prompts 6] [--delay-ms 43]
        [--json OUT]

Starts an embedded Redis and a tail process, runs the head here, and prints per drafter
(none, n-gram, draft model): tokens/s, tokens per round, and the mean per-round split
(draft, head forward, relay, tail forward + verify), beside a bare Redis PING round trip and a
bare stream round trip (XADD + XREAD of a payload of the same size as a round's packet), and the
relay's floor: the same Redis operations as a round (pipelined XADD + blocking XREAD; XREADGROUP, then
reply + XACK + XDEL) between two processes with no model and no codec.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import click
import torch

from bench.delay_proxy import spawn_proxy
from producer.local import spawn_tail, wait_for_tails
from relay_broker.connection import connect
from relay_broker.embedded import EmbeddedRedis
from relay_broker.streams import GroupReader, Reply, ReplyReader
from schemas.keys import Keys
from schemas.requests import DraftSettings, GenerationRequest

PROMPTS = [
    "The quick brown fox",
    "Once upon a time there was",
    "def main():\n    print(",
    "I am fine, thank you very much. I am fine,",
    "Numbers like 1, 2, 3, 42 and",
    "Hello world! How are",
]


def bare_round_trips(r, payload_bytes: int, n: int = 200) -> dict[str, float]:
    """Median PING and XADD+XREAD round trips (ms) on this Redis."""
    pings, streams = [], []
    blob = b"x" * payload_bytes
    for _ in range(n):
        t0 = time.perf_counter()
        r.ping()
        pings.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        r.xadd("bench:rt", {b"h": blob}, maxlen=10)
        r.xread({"bench:rt": "0-0"}, count=1)
        streams.append(time.perf_counter() - t0)
    r.delete("bench:rt")
    return {"ping_ms": statistics.median(pings) * 1000, "stream_rt_ms": statistics.median(streams) * 1000}


def _echo_tail(url: str, n: int) -> None:
    r = connect(url)
    reader = GroupReader(r, "bench:g", "echo", ["bench:req"])
    done = 0
    while done < n:
        for stream, entry_id, _ in reader.read(count=16, block_ms=1000):
            reader.ack_many([(stream, entry_id, Reply("bench:rep", {b"h": b"v" * 200}, 600))])
            done += 1


def relay_floor(url: str, payload_bytes: int, n: int = 500) -> float:
    """Median round (ms) of the relay's own Redis operations between two processes with no model and
    no packet codec: pipelined XADD + blocking XREAD on one side, XREADGROUP then reply + XACK + XDEL."""
    import multiprocessing

    r = connect(url)
    GroupReader(r, "bench:g", "setup", ["bench:req"])
    echo = multiprocessing.get_context("spawn").Process(target=_echo_tail, args=(url, n + 20))
    echo.start()
    reader = ReplyReader(r, "bench:rep")
    fields = {b"h": b"x" * 300, b"t.hidden": b"y" * payload_bytes}
    times = []
    for i in range(n + 20):
        t0 = time.perf_counter()
        reader.publish_then_next("bench:req", fields, 30)
        if i >= 20:
            times.append(time.perf_counter() - t0)
    echo.join(30)
    r.delete("bench:req", "bench:rep")
    return statistics.median(times) * 1000


def run_ladder(
    target: Path, split: int, draft: Path | None, new: int, n_prompts: int, k: int, delay_ms: float = 0.0
) -> dict:
    from transformers import AutoConfig

    from workers.head.runtime import HeadRuntime, generate

    n_layers = AutoConfig.from_pretrained(target).num_hidden_layers
    with EmbeddedRedis() as server, ExitStack() as stack:
        tail = spawn_tail(target, (split, n_layers), server.url)
        try:
            # with a delay, the head (and the PING beside it) reach Redis through the WAN delay proxy
            port = stack.enter_context(spawn_proxy(server.port, delay_ms / 1000)) if delay_ms > 0 else server.port
            r = connect(f"redis://127.0.0.1:{port}/0")
            runtime = HeadRuntime.load(target, (0, split), draft=draft)
            wait_for_tails(r, Keys(), proc=tail)
            rows = {}
            for kind in ("none", "ngram", "model") if draft else ("none", "ngram"):
                results = []
                for p in PROMPTS[:n_prompts]:
                    req = GenerationRequest(
                        prompt=p, max_new_tokens=new, chat_template=False, draft=DraftSettings(kind=kind, k=k)
                    )
                    generate(req, runtime, r)  # warm-up
                    results.append(generate(req, runtime, r))
                rounds = sum(x.rounds for x in results)
                tokens = sum(x.completion_tokens for x in results)
                total_s = sum(x.timings.total_ms for x in results) / 1000
                per_round = {
                    f: sum(getattr(x.timings, f) for x in results) / rounds
                    for f in ("draft_ms", "head_forward_ms", "relay_ms", "tail_forward_ms", "verify_ms")
                }
                rows[kind] = {
                    "tokens_per_s": tokens / total_s,
                    "tokens_per_round": tokens / rounds,
                    "per_round_ms": per_round,
                    "round_ms": total_s * 1000 / rounds,
                }
            hidden = runtime.shard.config.hidden_size
            bare = bare_round_trips(r, payload_bytes=(k + 1) * hidden * 4 + 400)
            bare["relay_floor_ms"] = relay_floor(server.url, (k + 1) * hidden * 4) if delay_ms <= 0 else None
            return {"rows": rows, "bare": bare, "threads": torch.get_num_threads()}
        finally:
            tail.terminate()
            tail.wait(30)


@click.command()
@click.option(
    "--target", type=click.Path(exists=True, file_okay=False), default=None, help="Target dir (default: tiny)."
)
@click.option("--split", type=int, default=None, help="First tail layer (default: half).")
@click.option("--draft", type=click.Path(exists=True, file_okay=False), default=None, help="Draft model dir.")
@click.option("--new", type=int, default=64, show_default=True, help="Tokens per generation.")
@click.option("--prompts", type=int, default=6, show_default=True, help="Prompts per row.")
@click.option("-k", type=int, default=8, show_default=True, help="Draft tokens per round.")
@click.option("--delay-ms", type=float, default=0.0, show_default=True, help="Head <-> Redis delay each way.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None, help="Also write results here.")
def main(target, split, draft, new, prompts, k, delay_ms, json_out) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        if target is None:
            from workers.tiny_models import save_noisy_copy, save_tiny_model

            target = save_tiny_model(Path(tmp) / "t", "qwen2", layers=8, hidden=256)
            draft = save_noisy_copy(target, Path(tmp) / "d", 0.02)
        from transformers import AutoConfig

        split = split or AutoConfig.from_pretrained(target).num_hidden_layers // 2
        out = run_ladder(Path(target), split, Path(draft) if draft else None, new, prompts, k, delay_ms)
    cols = ("tok/s", "tok/round", "round ms", "draft", "head", "relay", "tail+verify")
    click.echo(f"{'drafter':8} " + " ".join(f"{c:>9}" for c in cols))
    for kind, row in out["rows"].items():
        pr = row["per_round_ms"]
        click.echo(
            f"{kind:8} {row['tokens_per_s']:9.1f} {row['tokens_per_round']:9.2f} {row['round_ms']:9.2f} "
            f"{pr['draft_ms']:9.2f} {pr['head_forward_ms']:9.2f} {pr['relay_ms']:9.2f} "
            f"{pr['tail_forward_ms'] + pr['verify_ms']:9.2f}"
        )
    bare = out["bare"]
    relay = statistics.mean(r["per_round_ms"]["relay_ms"] for r in out["rows"].values())
    floor = bare["relay_floor_ms"]
    click.echo(
        f"bare Redis PING {bare['ping_ms']:.3f} ms, bare stream round trip {bare['stream_rt_ms']:.3f} ms; "
        f"relay per round {relay:.3f} ms = {relay / bare['ping_ms']:.2f}x PING"
        + (
            f"; the relay's Redis operations alone (two processes, no model or codec) {floor:.3f} ms = "
            f"{floor / bare['ping_ms']:.1f}x PING"
            if floor is not None
            else f" (+{delay_ms:g} ms each way)"
        )
    )
    if json_out:
        Path(json_out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
