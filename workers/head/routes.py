"""Which middle stages a head's rounds go through: a route through live workers that covers every layer once.

Middle stages (workers/stage/server.py) announce themselves in `stages`: a member "ID A:B" a stage, scored by when
its announcement expires. A head reads the live ones (one ZRANGEBYSCORE, at most every `REFRESH_S`) and chains
their ranges from where its own layers end: `stage:A-B` for the range that starts there, then the one that starts
at B, and so on; the tail takes the rest. Replicas of one range share its stream (one consumer group), so the route
names ranges, not workers, until a session's first verdict names the stages it passed through (it is pinned to
them then: `Generation`). With no stage announced the route is the tail alone: two workers, as before. Where two
announced ranges start at one layer, the longer goes first (fewer hops).
"""

from __future__ import annotations

import logging
import re
import threading
import time

import redis

from schemas.keys import Keys

log = logging.getLogger("shardflow.head")
REFRESH_S = 2.0
_MEMBER = re.compile(r"^([A-Za-z0-9_.-]{1,64}) ([0-9]{1,5}):([0-9]{1,5})$")


def chain(start: int, ranges: set[tuple[int, int]]) -> list[str]:
    """The hops from layer `start`: each announced range that starts where the last ended, the tail last."""
    hops: list[str] = []
    at, seen = start, set()
    while at not in seen:
        seen.add(at)
        nxt = max((b for a, b in ranges if a == at), default=None)
        if nxt is None:
            break
        hops.append(f"stage:{at}-{nxt}")
        at = nxt
    return [*hops, "tail"]


class Routes:
    """The live middle stages, as this head last read them (thread-safe; read at most every REFRESH_S)."""

    def __init__(self, start: int) -> None:
        self.start = start  # where the head's own layers end
        self._ranges: set[tuple[int, int]] = set()
        self._read_at = float("-inf")
        self._lock = threading.Lock()
        self._failing = False

    def route(self, r: redis.Redis, names: Keys) -> list[str]:
        """The hops a new session's rounds go through (the tail last). The first call reads the stages (one round
        trip); later ones never wait: a stale view is refreshed on a thread of its own while the last one serves
        (a job's intake over a WAN link must not pay a round trip every REFRESH_S)."""
        with self._lock:
            if self._read_at == float("-inf"):  # the first: read now, under the lock (concurrent firsts wait)
                self._read_at = time.monotonic()
                self._ranges = self._read(r, names)
            elif time.monotonic() - self._read_at >= REFRESH_S:
                self._read_at = time.monotonic()
                threading.Thread(target=self._refresh, args=(r, names), daemon=True, name="head-routes").start()
            return chain(self.start, set(self._ranges))

    def _refresh(self, r: redis.Redis, names: Keys) -> None:
        ranges = self._read(r, names)
        with self._lock:
            self._ranges = ranges

    def _read(self, r: redis.Redis, names: Keys) -> set[tuple[int, int]]:
        try:
            members = r.zrangebyscore(names.stages, time.time(), "+inf")
        except redis.RedisError as e:  # an ACL without it, Redis away: the tail alone until it answers
            if not self._failing:
                log.warning("head: cannot read the middle stages (%s): routing to the tail alone", e)
            self._failing = True
            return set()
        self._failing = False
        out: set[tuple[int, int]] = set()
        for m in members:
            got = _MEMBER.match(m.decode() if isinstance(m, bytes) else str(m))
            if got and int(got[2]) < int(got[3]):
                out.add((int(got[2]), int(got[3])))
        return out
