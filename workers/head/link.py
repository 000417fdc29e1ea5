"""What a head knows of its link to Redis, measured from its own traffic (no probes), and what it costs a draft.

Every publish of the head's sender threads (workers/head/relay_io.py) is noted: its bytes, its rows and when it
started and ended. A publish ends one round trip after its last byte went out, so over a window of recent ones:

- the round trip `rtt_s` is about the shortest publish (a small one crosses the link at once);
- while a publish's bytes are on the wire, the wire is busy: from its start until one round trip before its end.
  The union of those spans is the time the wire was busy, and `bandwidth` = the bytes published / that time (several
  sender threads share one wire, so the union, not the sum, counts). On a link faster than the head can fill, the
  spans are short and the bandwidth large: a wire cost near 0, and nothing changes;
- `row_bytes` = the bytes published / the rows in them (compressed, headers and MACs counted): what one more draft
  costs on the wire;
- `jitter_s`: how much publishes vary beyond what their size explains (mean absolute deviation).

`codec` is how a round's tensors go (schemas/codec.py `pick_codec` under `relay.wire_codec`): byte planes with zstd
where the measured link is slower than the codec pays for (raw until the link is measured, and on a fast one).
`hidden_codec` is how its hidden rows go: the same, or 8-bit under `relay.wire` fp8 / int8 (opt-in, lossy).

`draft_cost_ms` turns that into what each draft row costs a round on a shared wire: every generation in flight
sends its rows each round, so a round of N generations with k drafts each moves N (k + 1) rows, and one more
draft each costs N row_bytes / bandwidth (workers/speculative/adaptive.py `DraftLength` weighs it against the
tokens it is expected to commit). The number in flight is what the head's loops report (`in_flight`).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass

from schemas.codec import Codec, TensorCodec, hidden_codec, pick_codec
from schemas.settings import Wire, WireCodec

WINDOW_S = 5.0  # publishes older than this are forgotten
MIN_BUSY_BYTES = 1 << 20  # below this many bytes in the window the bandwidth is not estimated (None: unknown)


@dataclass(frozen=True)
class Publish:
    t0: float
    t1: float
    nbytes: int
    rows: int


class LinkMeter:
    """The head's link as its publishes show it (the module docstring); thread-safe (senders note, the loop reads)."""

    def __init__(self, window_s: float = WINDOW_S, wire_codec: WireCodec = "auto", wire: Wire = "lossless") -> None:
        self.window_s, self.wire_codec, self.wire = window_s, wire_codec, wire
        self._pubs: deque[Publish] = deque()
        self._lock = threading.Lock()
        self._in_flight: dict[int, int] = {}  # by loop: generations in flight
        self._cost: tuple[float, Codec, float] = (0.0, pick_codec(wire_codec, None), float("-inf"))  # and when

    def note_publish(self, t0: float, t1: float, nbytes: int, rows: int) -> None:
        with self._lock:
            self._pubs.append(Publish(t0, t1, nbytes, rows))
            while self._pubs and self._pubs[0].t1 < t1 - self.window_s:
                self._pubs.popleft()

    def in_flight(self, loop: int, n: int) -> None:
        """Loop `loop` has `n` generations in flight (seated)."""
        self._in_flight[loop] = n

    @property
    def sessions(self) -> int:
        return sum(self._in_flight.values())

    def estimate(self) -> LinkEstimate:
        """The link as the window shows it now."""
        with self._lock:
            pubs = list(self._pubs)
        if not pubs:
            return LinkEstimate(None, None, 0.0, None)
        rtt = min(p.t1 - p.t0 for p in pubs)
        spans = sorted((p.t0, max(p.t1 - rtt, p.t0)) for p in pubs)
        busy, end = 0.0, float("-inf")
        for a, b in spans:  # the union of the spans the wire was busy
            if b > end:
                busy += b - max(a, end)
                end = b
        nbytes, rows = sum(p.nbytes for p in pubs), sum(p.rows for p in pubs)
        bandwidth = nbytes / busy if nbytes >= MIN_BUSY_BYTES and busy > 0 else None
        row_bytes = nbytes / rows if rows else None
        if bandwidth is not None:
            residuals = [p.t1 - p.t0 - rtt - p.nbytes / bandwidth for p in pubs]
        else:
            residuals = [p.t1 - p.t0 - rtt for p in pubs]
        jitter = statistics.fmean(abs(x - statistics.fmean(residuals)) for x in residuals)
        return LinkEstimate(bandwidth, rtt, jitter, row_bytes)

    def draft_cost_ms(self) -> float:
        """What one more draft row of every generation in flight adds to a round, on the wire (ms); 0 where the
        bandwidth is not known (a link the head has not filled: as if unconstrained)."""
        return self._now()[0]

    def codec(self) -> Codec:
        """How the next round's tensors go (the module docstring)."""
        return self._now()[1]

    def hidden_codec(self) -> TensorCodec:
        """How the next round's hidden rows go (the module docstring)."""
        return hidden_codec(self.wire, self._now()[1])

    def _now(self) -> tuple[float, Codec]:
        """(draft_cost_ms, codec), estimated at most every 0.1 s (every verdict and round asks)."""
        cost, codec, at = self._cost
        now = time.monotonic()
        if now - at < 0.1:
            return cost, codec
        est = self.estimate()
        cost = 0.0
        if est.bandwidth is not None and est.row_bytes is not None:
            cost = 1000.0 * max(self.sessions, 1) * est.row_bytes / est.bandwidth
        codec = pick_codec(self.wire_codec, est.bandwidth)
        self._cost = (cost, codec, now)
        return cost, codec


@dataclass(frozen=True)
class LinkEstimate:
    bandwidth: float | None  # bytes/s delivered up the head's link (None: not measured yet)
    rtt_s: float | None
    jitter_s: float
    row_bytes: float | None  # bytes on the wire per hidden row sent (headers and MACs counted)
