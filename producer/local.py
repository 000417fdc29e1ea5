"""Run a whole split generation on one machine: embedded Redis, a tail process, the head in-process.

Used by `shardflow local`, the tests and the CPU bench.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import redis
from transformers import AutoConfig

from relay_broker.connection import connect
from relay_broker.embedded import EmbeddedRedis
from relay_broker.streams import StreamNames
from schemas.errors import TransportError
from schemas.requests import GenerationRequest, GenerationResult


def spawn_tail(
    target: str | Path,
    layers: tuple[int, int],
    redis_url: str,
    *,
    prefix: str = "shardflow",
    name: str | None = None,
    extra: list[str] | None = None,
    log_path: Path | None = None,
) -> subprocess.Popen:
    """Start `shardflow tail` as a child process."""
    args = [
        sys.executable,
        "-m",
        "producer",
        "tail",
        "--target",
        str(target),
        "--layers",
        f"{layers[0]}:{layers[1]}",
        "--redis-url",
        redis_url,
        "--prefix",
        prefix,
        *(["--name", name] if name else []),
        *(extra or []),
    ]
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL
    return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT if log_path else None)


def wait_for_tails(
    r: redis.Redis,
    names: StreamNames,
    count: int = 1,
    timeout_s: float = 60.0,
    proc: subprocess.Popen | None = None,
) -> None:
    """Block until `count` live tails read the shared stream (or the tail process exits).

    A consumer counts as live if it read within the last 3 s (tails block for at most block_ms),
    so a dead tail's leftover consumer entry does not count."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise TransportError(f"tail process exited with {proc.returncode}")
        try:
            consumers = r.xinfo_consumers(names.shared_requests, names.tail_group)
            if sum(int(c["idle"]) < 3000 for c in consumers) >= count:
                return
        except redis.ResponseError:
            pass
        time.sleep(0.1)
    raise TransportError(f"{count} tail(s) not ready within {timeout_s}s")


def run_local(
    target: str | Path | None, split: int | None, draft: str | None, requests: list[GenerationRequest]
) -> Iterator[GenerationResult]:
    """Yield the result of each request, served by a local tail process over an embedded Redis."""
    from workers.head import HeadRuntime, generate

    with tempfile.TemporaryDirectory(prefix="shardflow-local-") as tmp, EmbeddedRedis() as server:
        if target is None:
            from workers.tiny_models import save_tiny_model

            target = save_tiny_model(Path(tmp) / "tiny", "qwen2")
        n_layers = AutoConfig.from_pretrained(target).num_hidden_layers
        split = split if split is not None else n_layers // 2
        tail = spawn_tail(target, (split, n_layers), server.url)
        try:
            r = connect(server.url)
            runtime = HeadRuntime.load(target, (0, split), draft=draft)
            wait_for_tails(r, StreamNames(), proc=tail)
            for req in requests:
                yield generate(req, runtime, r)
        finally:
            tail.terminate()
            tail.wait(30)
