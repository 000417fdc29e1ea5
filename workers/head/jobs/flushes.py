"""Many jobs' Redis writes in one round trip each: the head's progress flushes and its jobs' final writes.

Over a WAN link every round trip costs the link's latency (86 ms in the benchmarks). A flush per job on a fixed
few threads caps a head at threads / RTT flushes a second: 46 with four threads, so at 256 jobs in flight each
job's first text waited seconds for its turn (time to first token 5-6 s on an H200, docs/runs/journal.md run 51).
`FlushPool` runs on `threads` threads that each take *every* flush queued when they come free and send them as one
pipeline: its cost per round trip stays one round trip, whatever the jobs in flight.

A flush is a `Progress`'s (workers/head/jobs/job_function.py) `queue_flush` (its commands appended to the shared
pipeline; what they are noted in a `FlushMark`) then `took_flush` (what Redis answered them: raises what that
flush found, a cancel request or a refused write, for that job alone). A pipeline that fails as a whole (Redis
away past its retries) fails every flush in it, as each would have failed alone.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import redis

from workers.drain import take_queued

log = logging.getLogger("shardflow.jobs")
MAX_BATCH = 1024  # flushes one pipeline carries at most (each a handful of commands)


@dataclass
class FlushMark:
    """Where a flush's commands sit in the shared pipeline, and what they were."""

    start: int
    end: int
    stream_at: int | None  # the token-stream XADD's index (relative to start), if any
    entry: str = ""
    fields: dict[bytes, bytes] = field(default_factory=dict)
    final: bool = False
    stores_result: bool = False


class Flushable(Protocol):
    def queue_flush(
        self, pipe: redis.client.Pipeline, generated: list[int], final: bool, result_json: str | None
    ) -> FlushMark: ...

    def took_flush(self, replies: list[Any], mark: FlushMark) -> bool: ...


@dataclass
class _Item:
    who: Flushable
    generated: list[int]
    final: bool
    result_json: str | None
    future: Future = field(default_factory=Future)


class FlushPool:
    """`threads` threads sending every queued flush in one pipeline (see the module docstring)."""

    def __init__(self, r: redis.Redis, threads: int = 2, name: str = "flusher") -> None:
        self.r = r
        self._q: queue.Queue[_Item | None] = queue.Queue()
        self._threads = [
            threading.Thread(target=self._run, daemon=True, name=f"{name}_{i}") for i in range(max(threads, 1))
        ]
        for t in self._threads:
            t.start()

    def submit(self, who: Flushable, generated: list[int], final: bool, result_json: str | None = None) -> Future:
        """Queue one flush; the Future holds what `took_flush` returns (or raises)."""
        item = _Item(who, generated, final, result_json)
        self._q.put(item)
        return item.future

    def shutdown(self) -> None:
        """Let the queued flushes go, then end the threads."""
        for _ in self._threads:
            self._q.put(None)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=30)

    def _run(self) -> None:
        while True:
            taken = take_queued(self._q, MAX_BATCH)
            batch = [item for item in taken if item is not None]
            if batch:
                run_flushes(self.r, batch)
            if len(batch) < len(taken):  # a stop (close queues one per thread, after every flush)
                for _ in range(len(taken) - len(batch) - 1):
                    self._q.put(None)  # the others' stops go back to them
                return


def run_flushes(r: redis.Redis, batch: list[_Item]) -> None:
    """Every item's commands in one pipeline, one round trip, then each item's answer to its own Future."""
    pipe = r.pipeline(transaction=False)
    marks: list[FlushMark | None] = []
    for item in batch:
        try:
            marks.append(item.who.queue_flush(pipe, item.generated, item.final, item.result_json))
        except BaseException as e:  # (a tokenizer that cannot decode, say): this flush alone
            item.future.set_exception(e)
            marks.append(None)
    if not any(m is not None for m in marks):
        return
    try:
        replies = pipe.execute(raise_on_error=False)
    except BaseException as e:  # the round trip failed: every flush in it did
        for item, mark in zip(batch, marks, strict=True):
            if mark is not None:
                item.future.set_exception(e)
        return
    for item, mark in zip(batch, marks, strict=True):
        if mark is None:
            continue
        try:
            item.future.set_result(item.who.took_flush(replies[mark.start : mark.end], mark))
        except BaseException as e:
            item.future.set_exception(e)
