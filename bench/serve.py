"""Requests per second and time to first token through `shardflow serve` (the official `openai` client,
streamed completions) against the producer `Client` (the CLI's path: enqueue, then follow the token stream),
with real tail and head worker processes on default flags and an embedded Redis.

    python -m bench.serve --smollm --n 1,8 --new-tokens 32 --out /tmp/serve_smol     # the demo's model
    python -m bench.serve --tiny --n 1,8 --out /tmp/serve_tiny

Each N sends N requests at once, each from a thread of its own (independent users: one request each), both
paths with the same prompts (as plain completions, no chat template) and greedy decoding. Writes serve.json
and serve.md to --out; the table goes to stdout.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click

from bench.jobs import spawn
from bench.jobs_models import resolve_model, say
from producer.client import Client, Followed, TextChunk
from producer.local import stop_processes, wait_for_tails
from relay_broker.connection import connect
from relay_broker.embedded import EmbeddedRedis, free_port
from schemas.keys import Keys
from schemas.requests import GenerationRequest
from workers.tiny_models import PROMPTS

PREFIX = "serve-bench"
# prompts a completion model continues for a while (the first of PROMPTS ends at once on SmolLM2)
LONG = [p for p in PROMPTS if len(p) > 12][1:]


def via_client(client: Client, prompt: str, new: int) -> tuple[float, float, int]:
    """(time to first text, total seconds, completion tokens) of one request through the Client."""
    t0 = time.perf_counter()
    req = GenerationRequest(prompt=prompt, chat_template=False, max_new_tokens=new)
    (jid,) = client.enqueue([req], retries=0).job_ids
    first = None
    for ev in client.follow([jid], timeout=600):
        if isinstance(ev, TextChunk) and ev.text and first is None:
            first = time.perf_counter() - t0
        if isinstance(ev, Followed):
            result = ev.views[0].result or {}
            return first or 0.0, time.perf_counter() - t0, int(result.get("completion_tokens", 0))
    raise RuntimeError("follow ended without the job")


def via_serve(base: str, prompt: str, new: int) -> tuple[float, float, int]:
    """The same through `shardflow serve`, streamed, with the openai client."""
    import openai

    api = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=600)
    t0, first, tokens = time.perf_counter(), None, 0
    stream = api.completions.create(
        model="bench", prompt=prompt, max_tokens=new, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    for c in stream:
        if c.choices and c.choices[0].text and first is None:
            first = time.perf_counter() - t0
        if c.usage is not None:
            tokens = c.usage.completion_tokens
    return first or 0.0, time.perf_counter() - t0, tokens


def run_n(fn, n: int, prompts: list[str], rounds: int) -> dict:
    """`rounds` times N requests at once (each round other prompts); medians over the rounds' figures."""
    walls, outs = [], []
    for r in range(rounds):
        t0 = time.perf_counter()
        with ThreadPoolExecutor(n) as pool:
            got = list(pool.map(fn, [prompts[(r * n + i) % len(prompts)] for i in range(n)]))
        walls.append(time.perf_counter() - t0)
        outs.append(got)
    tokens = [sum(o[2] for o in got) for got in outs]
    ttft = sorted(o[0] for got in outs for o in got)
    return {
        "n": n,
        "rounds": rounds,
        "wall_s": round(statistics.median(walls), 3),
        "requests_per_s": round(statistics.median(n / w for w in walls), 3),
        "tokens_per_s": round(statistics.median(t / w for t, w in zip(tokens, walls, strict=True)), 2),
        "completion_tokens": sum(tokens),
        "ttft_p50_s": round(statistics.median(ttft), 3),
        "ttft_max_s": round(ttft[-1], 3),
        "latency_p50_s": round(statistics.median(o[1] for got in outs for o in got), 3),
    }


@click.command()
@click.option("--tiny", is_flag=True, help="A tiny random model (built here).")
@click.option("--smollm", is_flag=True, help="SmolLM2-135M-Instruct, as the demo runs it.")
@click.option("--target", default=None, help="Any checkpoint directory.")
@click.option("--n", "ns", default="1,8", show_default=True, help="Requests at once, comma-separated.")
@click.option("--new-tokens", type=int, default=32, show_default=True)
@click.option("--rounds", type=int, default=3, show_default=True, help="Measurements per (path, N): medians.")
@click.option("--out", type=click.Path(file_okay=False), required=True)
def main(tiny: bool, smollm: bool, target: str | None, ns: str, new_tokens: int, rounds: int, out: str) -> None:
    outdir = Path(out)
    outdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis() as server:
        model = resolve_model(tiny, smollm, target, None, None, Path(tmp))
        opts = ["--target", model.target, "--prefix", PREFIX, "--redis-url", server.url]
        tail = spawn(["tail", *opts, "--layers", f"{model.split}:{model.layers}"], outdir / "tail.log")
        head = spawn(["head", *opts, "--layers", f"0:{model.split}", "--queue", PREFIX], outdir / "head.log")
        port = free_port()
        serve_args = ["-m", "producer", "serve", "--no-auth", "--port", str(port), *opts[2:], "--queue", PREFIX]
        serve_args += ["--served-model-name", "bench"]  # the name the requests below give
        api = subprocess.Popen([sys.executable, *serve_args], stdout=(outdir / "serve.log").open("ab"), stderr=-2)
        try:
            r = connect(server.url)
            wait_for_tails(r, Keys(PREFIX), proc=tail, timeout_s=600)
            client = Client(r, prefix=PREFIX, queue=PREFIX)
            base = f"http://127.0.0.1:{port}/v1"
            via_client(client, PROMPTS[0], 4)  # warm-up: the head's first job, and the API's first request
            for _ in range(100):
                try:
                    via_serve(base, PROMPTS[0], 4)
                    break
                except Exception:
                    time.sleep(0.2)
            rows = []
            for n in [int(x) for x in ns.split(",")]:
                for path, fn in (
                    ("client", lambda p: via_client(client, p, new_tokens)),
                    ("serve", lambda p: via_serve(base, p, new_tokens)),
                ):
                    row = run_n(fn, n, LONG, rounds)
                    say(f"{path} N={n}: {row}")
                    rows.append({"path": path, **row})
        finally:
            api.terminate()
            stop_processes([head, tail], 20.0)
            threading.Event().wait(0.1)
    (outdir / "serve.json").write_text(json.dumps({"model": model.name, "new_tokens": new_tokens, "rows": rows}))
    head_line = "| path | N | requests/s | tokens/s | tokens | TTFT p50 / max s | latency p50 s |\n"
    table = (
        head_line
        + "|---|---|---|---|---|---|---|\n"
        + "".join(
            f"| {x['path']} | {x['n']} | {x['requests_per_s']} | {x['tokens_per_s']} | {x['completion_tokens']} | "
            f"{x['ttft_p50_s']} / {x['ttft_max_s']} | {x['latency_p50_s']} |\n"
            for x in rows
        )
    )
    (outdir / "serve.md").write_text(table)
    click.echo(table)


if __name__ == "__main__":
    main()
