"""Soak: many tiny jobs through the real path (RQ head worker -> Redis streams -> tail), checking that
none is lost and that Redis memory comes back to where it started once results expire.

    python -m bench.soak --jobs 10000 --chunk 1000 --ttl 60

Runs an embedded Redis, a tail and a head worker process (`--concurrency 4`) on a tiny random model,
enqueues the jobs in chunks, checks every job of each chunk finished with a result, then waits for the
results' TTL and compares Redis `used_memory` with the figure measured after a warm-up.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

from schemas.keys import Keys


@click.command()
@click.option("--jobs", type=int, default=10_000, show_default=True)
@click.option("--chunk", type=int, default=1000, show_default=True)
@click.option("--ttl", type=int, default=60, show_default=True, help="Result TTL (s) during the soak.")
@click.option("--concurrency", type=int, default=4, show_default=True)
def main(jobs: int, chunk: int, ttl: int, concurrency: int) -> None:
    os.environ.update(SHARDFLOW_JOBS__RESULT_TTL_S=str(ttl), SHARDFLOW_REDIS__PREFIX="soak")
    from producer.client import Client
    from producer.local import spawn_tail, wait_for_tails
    from relay_broker.connection import connect
    from relay_broker.embedded import EmbeddedRedis
    from schemas.requests import DraftSettings, GenerationRequest
    from workers.tiny_models import save_tiny_model

    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis() as server:
        target = save_tiny_model(Path(tmp) / "tiny", "qwen2")
        r = connect(server.url)
        tail = spawn_tail(target, (2, 4), server.url, prefix="soak", extra=["--threads", "1"])
        head = subprocess.Popen(
            [sys.executable, "-m", "producer", "head", "--target", str(target), "--layers", "0:2", "--queue", "soak"]
            + ["--prefix", "soak", "--redis-url", server.url, "--threads", "1", "--concurrency", str(concurrency)],
            stdout=subprocess.DEVNULL,
            stderr=open(Path(tmp) / "head.log", "wb"),
        )
        try:
            wait_for_tails(r, Keys("soak"), proc=tail)
            client = Client(r, prefix="soak", queue="soak")
            req = GenerationRequest(prompt_ids=[5, 6, 7], max_new_tokens=2, draft=DraftSettings(kind="none"))

            def run_chunk(n: int) -> tuple[int, float]:
                batch = client.enqueue([req] * n, result_ttl=ttl)
                t0 = time.perf_counter()
                while True:
                    views = client.views(batch.job_ids)
                    if all(v.status in ("finished", "failed") for v in views):
                        return sum(v.status == "finished" and v.result is not None for v in views), t0
                    if time.perf_counter() - t0 > 600:
                        raise TimeoutError("chunk did not finish")
                    time.sleep(1.0)

            run_chunk(50)  # warm-up, then let it expire
            time.sleep(ttl + 8)
            mem0 = int(r.info("memory")["used_memory"])
            done, peak, started = 0, mem0, time.perf_counter()
            for at in range(0, jobs, chunk):
                ok, _ = run_chunk(min(chunk, jobs - at))
                done += ok
                peak = max(peak, int(r.info("memory")["used_memory"]))
                click.echo(f"{at + chunk:6d} jobs: {done} finished with results, used_memory {peak / 1e6:.2f} MB peak")
            wall = time.perf_counter() - started
            time.sleep(ttl + 10)  # results, job records and registries expire; workers clean registries
            mem1 = int(r.info("memory")["used_memory"])
            keys = r.dbsize()
            click.echo(
                f"soak: {done}/{jobs} jobs finished ({jobs / wall:.1f} jobs/s); Redis used_memory "
                f"{mem0 / 1e6:.2f} MB after warm-up, {peak / 1e6:.2f} MB peak, {mem1 / 1e6:.2f} MB at the end "
                f"({(mem1 - mem0) / 1e3:+.1f} kB), {keys} keys left"
            )
            sys.exit(0 if done == jobs else 1)
        finally:
            head.terminate()
            tail.terminate()
            head.wait(30)
            tail.wait(30)


if __name__ == "__main__":
    main()
