"""Which of a tail's sessions belong to heads that are gone, how many caches one head may hold, and the session a
round runs on (`session_for`).

A running head keeps `{prefix}:head:{name}` set to its boot id, expiring after its reply timeout
(workers/head/beacon.py). Nothing another process writes there is trusted to end a session at once:
- a session whose head's key was seen naming the session's boot is kept while the key still names it, and
  while the session has spoken within the reply timeout (the shorter of its head's and this tail's own,
  `relay.reply_timeout_s`) whatever the key says: gone, or another boot (a head that really restarted never
  speaks on its old sessions again, and a SET of the key by anyone else costs no live session anything);
- a session whose head's key was never seen naming its boot (a made-up head, or a real name with a made-up boot)
  goes once it is older than this tail's reply timeout, however often it speaks.
The tail checks every `head_check_s`, and at once (at most every `head_recheck_s`) when it is full or sees a head's
new boot.

A head may hold every cache while it is alone. Once another head was refused a cache for want of one (within the
last reply timeout), a head that holds `relay.head_share` of the caches or more gets no new session until it holds
fewer: its sessions end as their jobs do, and the freed caches go to the heads waiting.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, OrderedDict

import redis

from schemas.errors import SessionError, TailBusy
from schemas.keys import Keys
from schemas.packets import HeadRef, RoundPacket
from schemas.settings import Settings
from workers.engine.runner import Engine
from workers.tail.sessions import SessionStore, TailSession

log = logging.getLogger("shardflow.tail")
SEEN_MAX = 4096  # (head name, boot) pairs remembered as announced (heads are few; boots come with restarts)


class HeadWatch:
    """Drops the sessions of heads that died or restarted (one MGET per check), and keeps one head from taking
    the caches others wait for (see the module docstring)."""

    def __init__(self, r: redis.Redis, names: Keys, settings: Settings) -> None:
        self.r, self.names, self.settings = r, names, settings
        self.timeout_s = settings.relay.reply_timeout_s  # the longest any head's silent session is kept
        self._last = 0.0
        self._boots: dict[str, str] = {}  # the last boot seen per head name (heads are few)
        self._seen: OrderedDict[tuple[str, str], None] = OrderedDict()  # (name, boot) its key was seen naming
        self._refused: dict[str, float] = {}  # head name -> when it was last refused a cache (monotonic)

    def due(self, urgent: bool = False) -> bool:
        wait = self.settings.relay.head_recheck_s if urgent else self.settings.relay.head_check_s
        return time.monotonic() - self._last >= wait

    def new_boot(self, head: HeadRef) -> bool:
        """Note the head of a session opening here; whether an earlier one of that name had another boot (the
        head restarted: a check is worth making now)."""
        seen = self._boots.pop(head.name, None)
        self._boots[head.name] = head.boot  # the most recent last: the oldest go first beyond SEEN_MAX
        while len(self._boots) > SEEN_MAX:
            del self._boots[next(iter(self._boots))]
        return seen is not None and seen != head.boot

    def timeout_of(self, head: HeadRef) -> float:
        """How long a silent session of `head` is kept once its key is gone: its own reply timeout, at most this
        tail's (a packet may claim a day)."""
        return min(head.reply_timeout_s, self.timeout_s)

    def refused(self, name: str) -> None:
        """A head of that name found no free cache here (names refused longer ago than the reply timeout are
        forgotten once many are kept: a flood of made-up names holds no memory)."""
        now = time.monotonic()
        self._refused[name] = now
        if len(self._refused) > SEEN_MAX:
            self._refused = {n: t for n, t in self._refused.items() if now - t <= self.timeout_s}

    def may_open(self, head: HeadRef, sessions: SessionStore, slots: int) -> bool:
        """Whether `head` may open one more session: always while it holds less than its share of the caches, or
        while no other head was refused one within the reply timeout."""
        if sessions.held_by(head.name) < max(1, math.floor(self.settings.relay.head_share * slots)):
            return True
        since = time.monotonic() - self.timeout_s
        return not any(t >= since for name, t in self._refused.items() if name != head.name)

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
        for name, boot in boots.items():
            if boot is not None:
                self._saw(name, boot.decode(errors="replace"))
        for sid, s in held:
            head = s.head
            assert head is not None
            if (head.name, head.boot) not in self._seen:
                if now - s.opened <= self.timeout_s:
                    continue
                why = f"never announced boot {head.boot} in {self.timeout_s:g}s"
            else:
                boot = boots[head.name]
                if boot is not None and boot.decode(errors="replace") == head.boot:
                    continue
                if now - s.touched <= self.timeout_of(head):
                    continue  # its key expired, was lost or overwritten, but the session spoke recently
                why = f"was silent for over {self.timeout_of(head):g}s"
            gone[(head.name, why)] += 1
            sessions.drop(sid)
        for (name, why), n in gone.items():
            log.warning("dropped %d session(s): their head %s %s", n, name, why)
        return sum(gone.values())

    def _saw(self, name: str, boot: str) -> None:
        self._seen[(name, boot)] = None
        self._seen.move_to_end((name, boot))
        while len(self._seen) > SEEN_MAX:
            self._seen.popitem(last=False)


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
    else TailBusy, as for a head past its share while others wait), found for a later one (SessionError if this
    tail does not hold it where the round starts); None for a duplicate or late round, and for an opening round of
    a session that already ended here (`sessions.served`: never served twice). A replay keeps the id of the round
    whose verdict it missed: one at position 0 under the id this tail last answered, but not the packet it answered
    (`mac`), is that replay, not a duplicate (a long prompt's replay in parts starts with one, where the round it
    missed was another)."""
    sess = sessions.get(p.session_id)
    missed = sess is not None and p.start_pos == 0 and p.round_id == sess.last_round and mac != sess.last_mac
    if sess is not None and p.round_id <= sess.last_round and not missed:
        return None  # duplicate or late
    if p.start_pos == 0:
        if sess is None and sessions.served(p.session_id) is not None:
            return None
        if heads.new_boot(p.head):  # its head restarted? the old one's silent sessions may go now
            heads.sweep(sessions, urgent=True)
        if sess is not None:
            sessions.drop(p.session_id)
        if not heads.may_open(p.head, sessions, engine.slots):
            raise TailBusy(f"head {p.head.name} holds its share of tail {tail_id}'s caches while others wait")
        need = len(p.input_ids) + p.prefill_more + p.max_new + len(p.draft_ids) + 1  # positions it may hold
        cache = engine.acquire(overflow=False, need=need)  # full: busy (caches never outgrow memory)
        if cache is None and heads.sweep(sessions, urgent=True):
            cache = engine.acquire(overflow=False, need=need)
        if cache is None:
            heads.refused(p.head.name)
            raise TailBusy(f"the caches of tail {tail_id} that hold {need} positions are all in use")
        return sessions.open(p.session_id, cache, key, p.head)
    if sess is None:
        raise SessionError(f"unknown session {p.session_id} (expired, or this tail restarted)")
    if p.start_pos != sess.cache.length:
        raise SessionError(f"round {p.round_id} starts at {p.start_pos}, the session holds {sess.cache.length}")
    return sess
