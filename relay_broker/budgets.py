"""What a worker takes from and gives to Redis when another process floods it: a byte budget for reads and a rate
cap for dead letters. Anyone who may append to a stream a worker reads can make its entries huge or many; neither
may cost the worker its memory or the operators their audit trail.

- `ReadBudget`: Redis reads a stream by entry count, never by bytes, and says nothing of an entry's size before it
  sends it. So a read asks for at most `max_bytes / n` entries (one at least), n the largest entry seen lately
  (within `window_s` of traffic); after `window_s` without any entry, n is the largest entry allowed (`entry_max`,
  `relay.max_packet_bytes`): the first read after a quiet spell takes one entry, and a flood of 120 MB entries is
  taken one at a time, while normal rounds (kilobytes to a few megabytes a group) read as many as the caller wants.
- `DeadLetterCap`: a token bucket per source stream (`relay.dead_letter_rate` a second after a burst of
  `relay.dead_letter_burst`); what is over the cap is counted (`dropped`), for the worker's phase lines, never
  written, so one flood never cycles the dead-letter stream (`relay.dead_letter_maxlen`).
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

STREAMS_MAX = 1024  # source streams a cap keeps buckets for (the least recently used go)


def entry_bytes(fields: dict) -> int:
    """An entry's size as read: its field names and values."""
    return sum(len(k) + len(v) for k, v in fields.items() if isinstance(k, bytes | str) and isinstance(v, bytes | str))


@dataclass
class ReadBudget:
    """How many entries one read may ask for (see the module docstring)."""

    max_bytes: int
    entry_max: int
    window_s: float = 10.0
    _largest: int = field(default=0, init=False)
    _at: float = field(default=-math.inf, init=False)  # when `_largest` was set
    _last: float = field(default=-math.inf, init=False)  # when a read last brought entries

    def count(self, wanted: int) -> int:
        """Entries the next read asks for, at most `wanted`."""
        largest = self.entry_max if time.monotonic() - self._last > self.window_s else self._largest
        return max(1, min(wanted, self.max_bytes // max(largest, 1)))

    def saw(self, entries: Iterable[dict]) -> None:
        """Note the entries a read returned (their fields)."""
        size = max((entry_bytes(f) for f in entries), default=-1)
        if size < 0:
            return
        now = time.monotonic()
        if size >= self._largest or now - self._at > self.window_s:
            self._largest, self._at = size, now
        self._last = now


@dataclass
class DeadLetterCap:
    """Which dead letters of a source stream get written (see the module docstring); safe to call from several
    threads (a head's receivers and its loop share one)."""

    rate: float
    burst: int
    written: int = field(default=0, init=False)
    dropped: int = field(default=0, init=False)
    _buckets: OrderedDict[str, tuple[float, float]] = field(default_factory=OrderedDict, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def allow(self, stream: bytes | str) -> bool:
        """Whether one more dead letter from `stream` is written now (else it is only counted)."""
        with self._lock:
            return self._allow(stream.decode(errors="replace") if isinstance(stream, bytes) else stream)

    def _allow(self, key: str) -> bool:
        now = time.monotonic()
        tokens, at = self._buckets.pop(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - at) * self.rate)
        ok = tokens >= 1.0
        self._buckets[key] = (tokens - 1.0 if ok else tokens, now)
        while len(self._buckets) > STREAMS_MAX:
            self._buckets.popitem(last=False)
        if ok:
            self.written += 1
        else:
            self.dropped += 1
        return ok

    def take_counts(self) -> tuple[int, int]:
        """(written, dropped) since the last call."""
        with self._lock:
            counts = (self.written, self.dropped)
            self.written = self.dropped = 0
        return counts
