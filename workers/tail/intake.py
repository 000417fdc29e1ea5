"""The tail's intake, a thread beside its loop (workers/tail/server.py): it reads the next entries from Redis, unpacks
group entries into their sessions' rounds and checks every round's MAC while the loop runs the current batch's
forward, so that when the forward ends the next batch is read and checked already. On one H100 shared with its head,
at 256 jobs, a tail batch spent 6 ms reading, 10 ms decoding and checking and 27 ms in its forward, one after
another; a group that came during a forward waited for all three.

Batches read while the loop is busy are merged when it takes them (one forward for all, up to its slots). The intake
holds at most `slots` rounds read ahead; what it read stays pending in Redis until the loop acks it, so a tail that
dies with rounds read ahead leaves them to be read again (its own pending first) or claimed by another tail. A
Redis that goes away is ridden out here as in the loop (relay_broker/retry.py); the consumer groups are made again
before the next read.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from relay_broker.retry import ride_out
from relay_broker.streams import Entry, GroupReader
from schemas.errors import TransportError
from schemas.settings import Settings
from workers.phases import PhaseClock
from workers.tail.auth import Authenticated, Authenticator
from workers.tail.rounds import DeadLetter, entries_age_ms, expand_groups, read_ms

log = logging.getLogger("shardflow.tail")


@dataclass
class Taken:
    """Rounds read and checked: each flat entry (a group's parts keep its stream and entry id) with its check, the
    group entries refused whole, and when they were read (for the verdicts' timings)."""

    flat: list[Entry] = field(default_factory=list)
    checked: list[Authenticated | Exception] = field(default_factory=list)
    bad: list[tuple[bytes, bytes, DeadLetter]] = field(default_factory=list)
    queue_ms: float = 0.0  # how long the entries waited in Redis (mean, weighted by entries)
    taken_at_ms: float = 0.0  # when the first of them was read (wall clock)
    check_ms: float = 0.0  # unpacking and checking them
    entries: int = 0

    def merge(self, other: Taken) -> Taken:
        n = self.entries + other.entries
        queue = (self.queue_ms * self.entries + other.queue_ms * other.entries) / max(n, 1)
        first = min(t for t in (self.taken_at_ms, other.taken_at_ms) if t) if n else 0.0
        return Taken(
            self.flat + other.flat,
            self.checked + other.checked,
            self.bad + other.bad,
            queue,
            first,
            self.check_ms + other.check_ms,
            n,
        )


class Intake:
    """Reads and checks ahead of the loop on a thread of its own (see the module docstring); `take` hands over what
    it holds."""

    def __init__(
        self,
        reader: GroupReader,
        auth: Authenticator,
        *,
        slots: int,
        open_sessions: Callable[[], int],
        linger_ms: float,
        max_packet_bytes: int,
        settings: Settings,
        stop: threading.Event,
    ) -> None:
        self.reader, self.auth, self.slots, self.settings, self.stop = reader, auth, slots, settings, stop
        self.open_sessions, self.linger_ms, self.max_packet_bytes = open_sessions, linger_ms, max_packet_bytes
        self.clock = PhaseClock("tail intake", log)  # its waits at Redis, reads and checks, logged every 10 s
        self.regroup = False  # the consumer groups are made again before the next read (a Redis that restarted)
        self._held: Taken | None = None
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True, name="tail-intake")
            self._thread.start()

    def take(self, timeout_s: float) -> Taken | None:
        """Everything read and checked so far (at most the slots' worth, plus one read's), waiting up to
        `timeout_s` for something; None if nothing came."""
        with self._cv:
            if self._held is None:
                self._cv.wait(timeout_s)
            got, self._held = self._held, None
            self._cv.notify_all()
        return got

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                got = ride_out(
                    self._read,
                    errors=(TransportError, redis.RedisError),
                    stop=self.stop.is_set,
                    on_retry=self._lost,
                    sleep=self.stop.wait,
                    settings=self.settings,
                )
            except (TransportError, redis.RedisError):
                return  # stopped while Redis was away
            except Exception:  # never the end of a tail's intake: logged, and the next read goes on
                log.exception("tail: reading rounds failed; reading on")
                self.stop.wait(self.settings.redis.reconnect_min_s)
                continue
            if got is not None:
                self._hold(got)

    def _lost(self, e: BaseException, wait_s: float) -> None:
        log.warning("tail intake: %s; retrying in %.1fs", e, wait_s)
        self.regroup = True

    def _read(self) -> Taken | None:
        if self.regroup:
            self.reader.reset()
            self.regroup = False
        self.clock.maybe_log()
        called_ms, t0 = time.time() * 1000, time.perf_counter()
        entries = self.reader.gather(
            self.reader.read(count=self.slots),
            slots=self.slots,
            open_sessions=self.open_sessions(),
            linger_ms=self.linger_ms,
        )
        taken_at_ms = time.time() * 1000
        spent = time.perf_counter() - t0
        moved = min(read_ms(entries, called_ms, taken_at_ms) / 1000, spent)
        self.clock.add("wait", spent - moved)  # blocked at Redis; "read": the entries' way from Redis, parsed
        if not entries:
            return None
        self.clock.add("read", moved)
        t1 = time.perf_counter()
        flat, bad = expand_groups(entries, self.max_packet_bytes)  # a group entry: its sessions' rounds
        checked = self.auth.check([fields for _, _, fields in flat])
        check_s = time.perf_counter() - t1
        self.clock.add("check", check_s)
        return Taken(flat, checked, bad, entries_age_ms(entries), taken_at_ms, check_s * 1000, len(entries))

    def _hold(self, got: Taken) -> None:
        """Hand `got` to the loop, merged with what it has not taken yet; waits while that is a batch's worth."""
        with self._cv:
            while self._held is not None and len(self._held.flat) >= self.slots and not self.stop.is_set():
                self._cv.wait(0.1)
            self._held = got if self._held is None else self._held.merge(got)
            self._cv.notify_all()
