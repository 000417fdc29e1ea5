"""The tail's sessions: one KV cache per generation it serves, with the session's key and its head, dropped
when least recently used beyond a cap, when idle too long, when its head is gone (workers/tail/liveness.py),
or when the generation ends (see workers/tail/server.py). A session that ended with its final verdict is
remembered (its id and that verdict, the last `served_max`): an opening round under its id again is never served
again, only answered with the verdict it had."""

from __future__ import annotations

import logging
import os
import re
import secrets
import socket
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from schemas.packets import HeadRef
from workers.engine.shard import Cache

log = logging.getLogger("shardflow.tail")
TAIL_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def default_tail_id() -> str:
    """host-pid-random: a tail's name when it is given none."""
    host = "".join(c if c.isalnum() or c in "-_." else "-" for c in socket.gethostname())[:24]
    return f"{host}-{os.getpid()}-{secrets.token_hex(3)}"


@dataclass
class TailSession:
    cache: Cache
    key: bytes = b""  # every round of the session is MAC'd with it (schemas/packets.py)
    head: HeadRef | None = None
    last_round: int = -1
    last_reply: dict | None = None
    last_mac: bytes = b""  # the MAC of the packet that reply answered (a packet with the same id but not it is new)
    touched: float = field(default_factory=time.monotonic)
    opened: float = field(default_factory=time.monotonic)


class SessionStore:
    """Sessions by id: least recently used dropped beyond max_sessions, idle ones after ttl_s, with how many each
    head name holds (`held_by`). A dropped session's cache goes to `release` (the engine reuses static caches and
    their graphs). Sessions that ended with a final verdict are remembered (`finish`, `served`)."""

    def __init__(
        self,
        max_sessions: int,
        ttl_s: float,
        release: Callable[[Cache], None] | None = None,
        served_max: int | None = None,
    ) -> None:
        self.max_sessions, self.ttl_s, self.release = max_sessions, ttl_s, release
        self.served_max = 4 * max_sessions if served_max is None else served_max
        self._by_id: OrderedDict[str, TailSession] = OrderedDict()
        self._by_head: Counter[str] = Counter()
        self._served: OrderedDict[str, dict] = OrderedDict()  # ended sessions: their final verdict's fields

    def __len__(self) -> int:
        return len(self._by_id)

    def peek(self, sid: str) -> TailSession | None:
        """The session, without counting it as used (for a packet not yet authenticated)."""
        return self._by_id.get(sid)

    def items(self) -> list[tuple[str, TailSession]]:
        return list(self._by_id.items())

    def get(self, sid: str) -> TailSession | None:
        sess = self._by_id.get(sid)
        if sess is not None:
            self._by_id.move_to_end(sid)
            sess.touched = time.monotonic()
        return sess

    def held_by(self, head_name: str) -> int:
        """Sessions the head of that name holds here."""
        return self._by_head[head_name]

    def served(self, sid: str) -> dict | None:
        """The final verdict a session that ended here had (None: it never ended here, or long ago)."""
        return self._served.get(sid)

    def finish(self, sid: str, final: dict) -> None:
        """The session ended with the verdict `final`: dropped, and remembered as served."""
        self.drop(sid)
        self._served[sid] = final
        self._served.move_to_end(sid)
        while len(self._served) > self.served_max:
            self._served.popitem(last=False)

    def open(self, sid: str, cache: Cache, key: bytes = b"", head: HeadRef | None = None) -> TailSession:
        self.drop(sid)
        self._by_id[sid] = sess = TailSession(cache, key, head)
        if head is not None:
            self._by_head[head.name] += 1
        while len(self._by_id) > self.max_sessions:
            old = next(iter(self._by_id))
            log.info("session %s dropped (more than %d sessions)", old, self.max_sessions)
            self.drop(old)
        return sess

    def drop(self, sid: str) -> None:
        sess = self._by_id.pop(sid, None)
        if sess is None:
            return
        if sess.head is not None:
            self._by_head[sess.head.name] -= 1
            if self._by_head[sess.head.name] <= 0:
                del self._by_head[sess.head.name]
        if self.release is not None:
            self.release(sess.cache)

    def expire(self) -> None:
        cutoff = time.monotonic() - self.ttl_s
        for sid in [s for s, v in self._by_id.items() if v.touched < cutoff]:
            log.info("session %s expired after %.0fs idle", sid, self.ttl_s)
            self.drop(sid)
