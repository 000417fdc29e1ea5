"""Where a worker loop's time goes: named phases timed with `perf_counter`, logged as shares every `every_s`.

    clock = PhaseClock("head loop", log)
    with clock("compute"):
        ...
    clock.count("dead letters dropped", 3)   # events counted beside the phases
    clock.maybe_log()   # at most every every_s (default 10 s): "head loop: 10.0 s: compute 61% (4.1 ms x 150), ..."

The head's step loop and the tail's serve loop keep one each, so a run's logs say how much of the loop is
computing, building packets, taking replies and waiting (docs/runs/journal.md reads them). Cheap: two clock reads
per phase.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class PhaseClock:
    def __init__(self, name: str, logger: logging.Logger, every_s: float = 10.0) -> None:
        self.name, self.log, self.every_s = name, logger, every_s
        self.spent: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.counts: dict[str, int] = {}  # events counted since the last line (`count`)
        self._since = time.perf_counter()
        self._lock = threading.Lock()  # threads beside a loop may add to its clock (the head's senders do)

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, time.perf_counter() - t0)

    def add(self, phase: str, seconds: float) -> None:
        with self._lock:
            self.spent[phase] = self.spent.get(phase, 0.0) + seconds
            self.calls[phase] = self.calls.get(phase, 0) + 1

    def count(self, what: str, n: int = 1) -> None:
        """Count `n` events of `what` for the next line (nothing is logged for a count alone of 0)."""
        if n:
            with self._lock:
                self.counts[what] = self.counts.get(what, 0) + n

    def maybe_log(self) -> None:
        """Log the shares since the last line, if every_s has passed and anything but waiting was timed."""
        now = time.perf_counter()
        span = now - self._since
        if span < self.every_s:
            return
        with self._lock:
            spent, calls, counts = self.spent, self.calls, self.counts
            self.spent, self.calls, self.counts, self._since = {}, {}, {}, now
        busy = {k: v for k, v in spent.items() if k != "wait"}
        if (busy and sum(busy.values()) > 0.01 * span) or counts:
            parts = [
                f"{k} {100 * v / span:.0f}% ({1000 * v / max(calls[k], 1):.1f} ms x {calls[k]})"
                for k, v in sorted(spent.items(), key=lambda kv: -kv[1])
            ]
            parts += [f"{k} {n:,}" for k, n in sorted(counts.items())]
            self.log.info("%s: %.1f s: %s", self.name, span, ", ".join(parts))
