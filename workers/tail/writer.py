"""A tail's (or a middle stage's) writes on a thread of its own: each batch's replies, rounds passed on, acks and dead
letters (`GroupReader.ack_many`, one round trip) while the serve loop reads and computes the next batch.

A worker far from its Redis (a notebook's tail 43 ms from the relay VM) paid a whole round trip a batch on its loop
for these writes, during which rounds that had come waited unread: a tiny-model tail behind the `wan` link, 8 jobs,
rounds waited 81 ms in its queue (bench.jobs --tail-link wan). One thread writes the batches in the order they were
computed; at most `depth` batches wait for it, so a Redis slower than the device holds the loop back rather than
letting replies pile up. Redis lost: the write is ridden out (relay_broker/retry.py) until it succeeds or the worker
stops; a write Redis refuses outright (its groups gone with a restart) is logged and dropped: its entries, never
acknowledged, are read again or were lost with that Redis.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
from collections.abc import Callable

import redis

from relay_broker.retry import REDIS_LOST, ride_out
from relay_broker.streams import GroupReader, Reply
from schemas.settings import Settings
from workers.phases import PhaseClock

log = logging.getLogger("shardflow.tail")
Done = list[tuple[bytes | str, bytes, Reply | None]]


class Writer:
    """Writes the batches `put` to it, in order, on one thread (see the module docstring)."""

    def __init__(
        self, reader: GroupReader, settings: Settings, clock: PhaseClock, stop: Callable[[], bool], depth: int = 2
    ) -> None:
        self.reader, self.settings, self.clock, self.stop = reader, settings, clock, stop
        self._queue: queue.Queue[tuple[Done, list[dict]] | None] = queue.Queue(maxsize=depth)
        self._thread = threading.Thread(target=self._run, daemon=True, name="tail-writer")
        self._thread.start()

    def put(self, done: Done, dead: list[dict]) -> None:
        """Queue a batch's writes (blocks while `depth` batches wait: backpressure)."""
        with self.clock("reply"):  # the loop's own time: waiting for room, when Redis is slower than the device
            self._queue.put((done, dead))

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued, then end the thread."""
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            done, dead = item
            try:
                ride_out(
                    functools.partial(self.reader.ack_many, done, dead_letters=dead),
                    errors=REDIS_LOST,
                    stop=self.stop,
                    on_retry=lambda e, s: log.warning("tail writes: %s; retrying in %.1fs", e, s),
                    settings=self.settings,
                )
            except (*REDIS_LOST, redis.RedisError) as e:  # stopped while Redis was away, or refused outright
                log.warning("tail writes: %d entries' replies and acks dropped (%s)", len(done), e)
            except Exception:  # a bug: logged, the loop goes on; the entries stay pending and are read again
                log.exception("tail writes failed")
