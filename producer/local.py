"""Run a whole split generation on one machine: embedded Redis, a tail process, the head in-process.

Used by `shardflow local`, the tests and the CPU bench.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis
from transformers import AutoConfig

from relay_broker.connection import connect
from relay_broker.embedded import EmbeddedRedis
from schemas.errors import InvalidRequest, ModelLoadError, TransportError
from schemas.keys import Keys
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
    die_with_parent: bool = False,
) -> subprocess.Popen:
    """Start `shardflow tail` as a child process (on Linux, with die_with_parent, it gets SIGTERM when the
    calling thread ends, even by SIGKILL: see relay_broker.embedded.child_setup)."""
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
    from relay_broker.embedded import child_setup

    setup = child_setup(True) if die_with_parent else None
    return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT if log_path else None, preexec_fn=setup)


def stop_processes(procs: list[subprocess.Popen], grace_s: float = 15.0) -> None:
    """SIGTERM each child's process group (workers finish warm), SIGKILL what is still there after grace_s."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


def wait_for_tails(
    r: redis.Redis,
    names: Keys,
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


@contextmanager
def interrupt_on_termination() -> Iterator[None]:
    """While entered (in the main thread), SIGTERM and SIGHUP raise KeyboardInterrupt like Ctrl-C, so they
    stop what Ctrl-C stops (the embedded Redis, worker processes) instead of killing this process around
    them; a repeated signal does not interrupt that cleanup."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired: list[int] = []

    def interrupt(signum: int, frame: object) -> None:
        if not fired:
            fired.append(signum)
            raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def layer_count(target: str | Path) -> int:
    """The model's number of layers, from its config; ModelLoadError if there is no readable config."""
    try:
        return int(AutoConfig.from_pretrained(target).get_text_config(decoder=True).num_hidden_layers)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read the model config of {target}: {e}") from None


def run_local(
    target: str | Path | None, split: int | None, draft: str | None, requests: list[GenerationRequest]
) -> Iterator[GenerationResult]:
    """Yield the result of each request, served by a local tail process over an embedded Redis (stopped on
    Ctrl-C, SIGTERM or SIGHUP too)."""
    with interrupt_on_termination(), tempfile.TemporaryDirectory(prefix="shardflow-local-") as tmp:
        if target is None:
            from workers.tiny_models import save_tiny_model

            target = save_tiny_model(Path(tmp) / "tiny", "qwen2")
        n_layers = layer_count(target)
        split = split if split is not None else n_layers // 2
        if not 0 < split < n_layers:
            raise InvalidRequest(f"--split {split}: the model has {n_layers} layers, so give 1 to {n_layers - 1}")
        yield from _serve_local(target, (split, n_layers), draft, requests)


def _serve_local(
    target: str | Path, layers: tuple[int, int], draft: str | None, requests: list[GenerationRequest]
) -> Iterator[GenerationResult]:
    """run_local once the model is known: embedded Redis, a tail process for `layers`, the head here."""
    from workers.head.runtime import HeadRuntime, generate

    split = layers[0]
    with EmbeddedRedis(die_with_parent=True) as server:
        tail = spawn_tail(target, layers, server.url, die_with_parent=True)
        try:
            r = connect(server.url)
            runtime = HeadRuntime.load(target, (0, split), draft=draft)
            wait_for_tails(r, Keys(), proc=tail)
            for req in requests:
                yield generate(req, runtime, r)
        finally:
            tail.terminate()
            tail.wait(30)
