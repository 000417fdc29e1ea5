"""Which of a tail's sessions belong to heads that are gone, and the session a round runs on (`session_for`).

A running head keeps `{prefix}:head:{name}` set to its boot id, expiring after its reply timeout
(workers/head/beacon.py). A session is its head's if the key still names the boot the session's rounds
carried. Its head is gone when the key names another boot (the head restarted under the same name: its old
sessions go at once) or when the key has expired and the session has been silent longer than that head's
reply timeout (the head was killed; it would have replayed elsewhere by then anyway). The tail checks every
`head_check_s`, and at once (at most every `head_recheck_s`) when it is full or sees a head's new boot.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import redis

from schemas.errors import SessionError, TailBusy
from schemas.keys import Keys
from schemas.packets import HeadRef, RoundPacket
from schemas.settings import Settings
from workers.engine.runner import Engine
from workers.tail.sessions import SessionStore, TailSession

log = logging.getLogger("shardflow.tail")


class HeadWatch:
    """Drops the sessions of heads that died or restarted (one MGET per check)."""

    def __init__(self, r: redis.Redis, names: Keys, settings: Settings) -> None:
        self.r, self.names, self.settings = r, names, settings
        self._last = 0.0
        self._boots: dict[str, str] = {}  # the last boot seen per head name (heads are few)

    def due(self, urgent: bool = False) -> bool:
        wait = self.settings.relay.head_recheck_s if urgent else self.settings.relay.head_check_s
        return time.monotonic() - self._last >= wait

    def new_boot(self, head: HeadRef) -> bool:
        """Note the head of a session opening here; whether an earlier one of that name had another boot (the
        head restarted: a check is worth making now)."""
        seen = self._boots.get(head.name)
        self._boots[head.name] = head.boot
        return seen is not None and seen != head.boot

    def sweep(self, sessions: SessionStore, urgent: bool = False) -> int:
        """Drop the sessions whose head is gone (when a check is due); how many were dropped."""
        if not self.due(urgent):
            return 0
        self._last = time.monotonic()
        held = [(sid, s) for sid, s in sessions.items() if s.head is not None]
        names = sorted({s.head.name for _, s in held})  # type: ignore[union-attr]
        if not names:
            return 0
        try:
            boots = dict(zip(names, self.r.mget([self.names.head(n) for n in names]), strict=True))
        except redis.RedisError as e:  # nothing is dropped on a guess
            log.debug("head check skipped: %s", e)
            return 0
        now, gone = time.monotonic(), Counter()
        for sid, s in held:
            head = s.head
            assert head is not None
            boot = boots[head.name]
            if boot is not None and boot.decode(errors="replace") == head.boot:
                continue
            if boot is None and now - s.touched <= head.reply_timeout_s:
                continue  # its key expired (or Redis lost it) but the session spoke recently
            why = "restarted" if boot is not None else f"was silent for over {head.reply_timeout_s:g}s"
            gone[(head.name, why)] += 1
            sessions.drop(sid)
        for (name, why), n in gone.items():
            log.warning("dropped %d session(s): their head %s %s", n, name, why)
        return sum(gone.values())


def keep_alive(r: redis.Redis, names: Keys, tail_id: str, settings: Settings) -> None:
    """Keep a tail's own stream from expiring (a dead tail's goes after tail_stream_ttl_s) and drop consumers of
    the shared group that have been idle that long."""
    ttl_s = settings.relay.tail_stream_ttl_s
    try:
        r.expire(names.tail_requests(tail_id), ttl_s)
        shared, group = names.shared_requests, names.tail_group
        for c in r.xinfo_consumers(shared, group):
            if int(c["idle"]) > ttl_s * 1000 and int(c["pending"]) == 0:
                r.xgroup_delconsumer(shared, group, c["name"])
    except redis.RedisError as e:
        log.debug("keepalive skipped: %s", e)


def session_for(
    p: RoundPacket, key: bytes, sessions: SessionStore, heads: HeadWatch, engine: Engine, tail_id: str, mac: bytes
) -> TailSession | None:
    """The session an authentic round runs on: opened for a round at position 0 (a new session, or one replayed
    onto this tail: its old cache goes back first; when every cache is taken, dead heads' sessions go first,
    else TailBusy), found for a later one (SessionError if this tail does not hold it where the round starts);
    None for a duplicate or late round. A replay keeps the id of the round whose verdict it missed: one at position
    0 under the id this tail last answered, but not the packet it answered (`mac`), is that replay, not a
    duplicate (a long prompt's replay in parts starts with one, where the round it missed was another)."""
    sess = sessions.get(p.session_id)
    missed = sess is not None and p.start_pos == 0 and p.round_id == sess.last_round and mac != sess.last_mac
    if sess is not None and p.round_id <= sess.last_round and not missed:
        return None  # duplicate or late
    if p.start_pos == 0:
        if heads.new_boot(p.head):  # its head restarted? the old one's sessions may go now
            heads.sweep(sessions, urgent=True)
        if sess is not None:
            sessions.drop(p.session_id)
        need = len(p.input_ids) + p.prefill_more + p.max_new + len(p.draft_ids) + 1  # positions it may hold
        cache = engine.acquire(overflow=False, need=need)  # full: busy (caches never outgrow memory)
        if cache is None and heads.sweep(sessions, urgent=True):
            cache = engine.acquire(overflow=False, need=need)
        if cache is None:
            raise TailBusy(f"the caches of tail {tail_id} that hold {need} positions are all in use")
        return sessions.open(p.session_id, cache, key, p.head)
    if sess is None:
        raise SessionError(f"unknown session {p.session_id} (expired, or this tail restarted)")
    if p.start_pos != sess.cache.length:
        raise SessionError(f"round {p.round_id} starts at {p.start_pos}, the session holds {sess.cache.length}")
    return sess
