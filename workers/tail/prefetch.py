"""A tail's (or a middle stage's) reads on a thread of its own: the next batch of entries read from Redis (its own
pending ones first, claims, then new ones, gathered as `GroupReader.gather` says) while the serve loop computes this
one, at most `depth` batches ahead; none ahead of a batch of more than a quarter of `relay.read_max_bytes` (a worker
holds one large batch at a time, as it did reading on its loop).

Read on the loop, a batch's read cost a worker far from its Redis a round trip after every batch before the rounds
that had come meanwhile were even seen (the writes went to workers/tail/writer.py's thread first). Redis lost: the
read is ridden out (relay_broker/retry.py), the consumer groups made again before the next one (a Redis restarted
without persistence lost them), until it succeeds or the worker stops. Entries read ahead but never computed (the
worker stopped or died) stay pending in their group: read again at the next start, or claimed by another replica.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

import redis

from relay_broker.budgets import entry_bytes
from relay_broker.retry import ride_out
from relay_broker.streams import Entry
from schemas.errors import TransportError
from schemas.settings import Settings

log = logging.getLogger("shardflow.tail")


class Prefetch:
    """Reads batches with `read` on one thread, in order, for the loop to `take` (see the module docstring)."""

    def __init__(
        self,
        read: Callable[[], list[Entry]],
        reset: Callable[[], None],
        stop: threading.Event,
        settings: Settings,
        name: str,
        depth: int = 1,
    ) -> None:
        self.read, self.reset, self.stop, self.settings, self.name = read, reset, stop, settings, name
        self._queue: queue.Queue[tuple[int, list[Entry]]] = queue.Queue(maxsize=depth)
        self._regroup = False
        self._cv = threading.Condition()
        self._made, self._taken, self._done = 0, 0, 0  # batches read, taken by the loop, and computed
        self._big = settings.relay.read_max_bytes // 4  # a batch this large is not read ahead of (memory)
        self._thread = threading.Thread(target=self._run, daemon=True, name="tail-reader")
        self._thread.start()

    def take(self, timeout_s: float) -> list[Entry]:
        """The next batch read, or [] when none came within `timeout_s`."""
        try:
            self._taken, entries = self._queue.get(timeout=timeout_s)
        except queue.Empty:
            return []
        return entries

    def finished(self) -> None:
        """The loop has computed the batch it took last (a large one's reads may go on)."""
        with self._cv:
            self._done = self._taken
            self._cv.notify_all()

    def _lost(self, e: BaseException, wait_s: float) -> None:
        log.warning("%s: %s; retrying in %.1fs", self.name, e, wait_s)
        self._regroup = True  # a Redis restarted without persistence lost the consumer groups

    def _read_once(self) -> list[Entry]:
        if self._regroup:
            self.reset()
            self._regroup = False
        return self.read()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                entries = ride_out(
                    self._read_once,
                    errors=(TransportError, redis.RedisError),
                    stop=self.stop.is_set,
                    on_retry=self._lost,
                    sleep=self.stop.wait,
                    settings=self.settings,
                )
            except (TransportError, redis.RedisError):
                return  # stopped while Redis was away
            except Exception:  # a bug: logged, the reads go on (what was read stays pending, read again later)
                log.exception("%s: a read failed", self.name)
                self.stop.wait(1.0)
                continue
            if not entries:
                continue
            self._made += 1
            seq, big = self._made, sum(entry_bytes(fields) for _, _, fields in entries) > self._big
            while not self.stop.is_set():
                try:
                    self._queue.put((seq, entries), timeout=0.5)  # waits while the loop has `depth` batches to take
                    break
                except queue.Full:
                    continue
            entries = []  # the loop's now: held here, a large batch would stay in memory through the next read
            if big:  # read no more until it is computed: a worker holds one large batch at a time
                self._wait_computed(seq)

    def _wait_computed(self, seq: int) -> None:
        with self._cv:
            while self._done < seq and not self.stop.is_set():
                self._cv.wait(0.5)
