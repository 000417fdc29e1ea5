"""The relay operations on Redis streams: publish, consume through a group, ack, reply to a head's stream, trim,
dead-letter.

Key names are in schemas/keys.py.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import redis

from relay_broker.budgets import ReadBudget, entry_bytes
from relay_broker.connection import transport_retry
from schemas.groups import MAC_BYTES, pack_group, rounds_in
from schemas.keys import Keys
from schemas.packets import MAC
from schemas.settings import Settings

Entry = tuple[bytes, bytes, dict[bytes, bytes]]  # (stream, entry id, fields)
log = logging.getLogger("shardflow.relay")


@transport_retry()
def publish_many(
    r: redis.Redis,
    entries: list[tuple[str, dict]],
    *,
    maxlen: int,
    dead: list[tuple[str, dict]] | None = None,
    dead_maxlen: int | None = None,
) -> None:
    """Append each (stream, fields) entry, every stream trimmed to about `maxlen`, and each dead-letter record
    to its stream (trimmed to about `dead_maxlen`): one round trip. A refused dead letter fails nothing."""
    pipe = r.pipeline(transaction=False)
    for stream, fields in entries:
        pipe.xadd(stream, fields, maxlen=maxlen, approximate=True)
    for stream, fields in dead or []:
        pipe.xadd(stream, fields, maxlen=dead_maxlen or maxlen, approximate=True)
    replies = pipe.execute(raise_on_error=False)
    for reply in replies[: len(entries)]:
        if isinstance(reply, Exception):
            raise reply


class Reply(NamedTuple):
    """A reply for a head's reply stream (`reply:head.NAME.BOOT[.EPOCH]`), where it reads every one of its sessions'
    replies (the stream is the head's to make and keep: workers/head/beacon.py); or, `onward`, a round a middle
    stage passes on to its next hop's request stream (workers/stage/server.py), never merged with others."""

    stream: str
    fields: dict
    onward: bool = False


def merge_replies(done: list[tuple[bytes | str, bytes, Reply | None]]) -> list[tuple[bytes | str, bytes, Reply | None]]:
    """The same acks with the replies bound for one head's stream packed into one entry (schemas/groups.py; an
    unsigned reply gets an all-zero MAC, which never verifies), carried by the first of them."""
    by_stream: dict[str, list[int]] = {}
    for i, (_, _, reply) in enumerate(done):
        if reply is not None:
            by_stream.setdefault(reply.stream, []).append(i)
    out = list(done)
    for stream, at in by_stream.items():
        if len(at) < 2:
            continue
        parts = [{MAC: bytes(MAC_BYTES), **done[i][2].fields} for i in at]  # type: ignore[union-attr]
        packed = Reply(stream, pack_group(parts))
        for n, i in enumerate(at):
            out[i] = (done[i][0], done[i][1], packed if n == 0 else None)
    return out


def make_reply_stream(pipe: redis.client.Pipeline, stream: str, group: str, ttl_s: int) -> None:
    """Queue what makes a head's reply stream: its consumer group (from the start, the stream made with it; a
    BUSYGROUP answer means it is there already) and its expiry."""
    pipe.xgroup_create(stream, group, id="0", mkstream=True)
    pipe.expire(stream, ttl_s)


def add_reply(pipe: redis.client.Pipeline, reply: Reply, maxlen: int) -> None:
    """Queue a reply on its head's stream, kept to about `maxlen` entries. Never makes the stream: one that is gone
    (its head stopped, or moved to a fresh stream) drops the reply rather than come back without an expiry."""
    pipe.xadd(reply.stream, reply.fields, maxlen=maxlen, approximate=True, nomkstream=True)


GATHER_POLL_S = 0.0005  # how often a lingering tail asks Redis for more (`GroupReader.gather`)


@dataclass
class GroupReader:
    """Reads streams through one consumer group: own pending entries first, then new ones."""

    r: redis.Redis
    group: str
    consumer: str
    streams: list[str]
    claim_streams: list[str] = field(default_factory=list)  # streams whose stale entries this reader takes over
    dead_stream: str = Keys().dead_letters
    settings: Settings = field(default_factory=Settings)  # claim_idle_ms, block_ms, stream caps
    _pending_done: bool = field(default=False, init=False)
    _last_claim: float = field(default=0.0, init=False)
    _poll_s: float = field(default=0.0, init=False)  # a `poll`'s round trip, averaged (`gather` skips a far Redis)
    _refusals: set[str] = field(default_factory=set, init=False)  # streams whose refused writes were logged

    def __post_init__(self) -> None:
        self.budget = ReadBudget(
            self.settings.relay.read_max_bytes, self.settings.relay.max_packet_bytes
        )  # a flood of huge entries: one a read
        self.reset()

    def reset(self) -> None:
        """(Re)create the groups (a restarted Redis without persistence lost them); read own pending first."""
        self._pending_done = False
        for s in self.streams:
            self._create_group(s)

    @transport_retry()
    def _create_group(self, stream: str) -> None:
        try:
            self.r.xgroup_create(stream, self.group, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    @transport_retry()
    def read(self, count: int = 16, block_ms: int | None = None) -> list[Entry]:
        """Return up to `count` entries (fewer while huge ones come: `budget`); blocks up to block_ms
        (settings.redis.block_ms) when there is nothing new."""
        got = self._read(self.budget.count(count), self.settings.redis.block_ms if block_ms is None else block_ms)
        self.budget.saw(fields for _, _, fields in got)
        return got

    def _read(self, count: int, block_ms: int) -> list[Entry]:
        if not self._pending_done:
            got = self._flatten(
                self.r.xreadgroup(self.group, self.consumer, dict.fromkeys(self.streams, "0"), count=count)
            )
            got = [e for e in got if e[2]]  # entries deleted while pending come back empty
            if got:
                return got
            self._pending_done = True
        if self.claim_streams and time.monotonic() - self._last_claim > self.settings.relay.claim_idle_ms / 2000:
            self._last_claim = time.monotonic()
            claimed = self._claim(count)
            if claimed:
                return claimed
        return self._flatten(
            self.r.xreadgroup(self.group, self.consumer, dict.fromkeys(self.streams, ">"), count=count, block=block_ms)
        )

    def gather(self, entries: list[Entry], *, slots: int, open_sessions: int, linger_ms: float) -> list[Entry]:
        """With a linger (a CPU tail): while fewer entries are read than sessions are open, read more as long as
        they keep coming, each within the linger of the last (at most 4 reads, never more than 50 lingers in all,
        and never past the byte budget): rounds that come apart (several heads', or a head's rounds sent one entry
        each) then run as one batched forward, which on a CPU costs little more than one sequence's.

        The linger polls (`poll`, every GATHER_POLL_S) rather than BLOCKs: Redis times blocked reads out only when
        its event loop wakes, as rarely as every 100 ms at its default `hz` 10, so a 5 ms BLOCK that found nothing
        held a CPU tail up to 100 ms, and 4 generations in flight ran 7x slower than one at a time. A worker whose polls
        take longer than the linger (its Redis across a WAN: each a round trip) does not linger at all."""
        if not entries or linger_ms <= 0 or self._poll_s * 1000 > linger_ms:
            return entries  # a read costs more than the linger (Redis far away): waiting for more would cost more
        deadline, reads = time.monotonic() + 50 * linger_ms / 1000, 0
        held = sum(entry_bytes(fields) for _, _, fields in entries)
        rounds = sum(rounds_in(fields) for _, _, fields in entries)  # a head's group entry: its sessions' rounds
        while rounds < slots and held < self.budget.max_bytes:  # the byte budget holds for the whole batch
            if reads >= 4 or rounds >= min(open_sessions, slots):
                break
            until = min(deadline, time.monotonic() + linger_ms / 1000)
            more = self.poll(slots - len(entries))
            while not more and time.monotonic() + GATHER_POLL_S <= until:
                time.sleep(GATHER_POLL_S)
                more = self.poll(slots - len(entries))
            reads += 1
            if not more:
                break
            entries = entries + more
            held += sum(entry_bytes(fields) for _, _, fields in more)
            rounds += sum(rounds_in(fields) for _, _, fields in more)
        return entries

    @transport_retry()
    def poll(self, count: int) -> list[Entry]:
        """New entries, up to `count` (fewer while huge ones come: `budget`), without blocking."""
        streams, t0 = dict.fromkeys(self.streams, ">"), time.monotonic()
        got = self._flatten(self.r.xreadgroup(self.group, self.consumer, streams, count=self.budget.count(count)))
        self._poll_s += (time.monotonic() - t0 - self._poll_s) / 4  # how long one costs, recently (`gather`)
        self.budget.saw(fields for _, _, fields in got)
        return got

    def _claim(self, count: int) -> list[Entry]:
        """Entries that another consumer read but never acknowledged for claim_idle_ms (a dead tail's)."""
        out: list[Entry] = []
        for stream in self.claim_streams:
            idle = self.settings.relay.claim_idle_ms
            resp = self.r.xautoclaim(stream, self.group, self.consumer, idle, "0-0", count=count)
            out += [(stream.encode(), i, f) for i, f in resp[1] if f]
        return out

    @staticmethod
    def _flatten(resp: list | None) -> list[Entry]:
        return [(s, i, f) for s, entries in (resp or []) for i, f in entries]

    def ack(self, stream: bytes | str, entry_id: bytes, reply: Reply | None = None) -> None:
        """Send the entry's reply (if any), then acknowledge and delete the entry: one round trip."""
        self.ack_many([(stream, entry_id, reply)])

    @transport_retry()
    def ack_many(
        self,
        done: list[tuple[bytes | str, bytes, Reply | None]],
        dead_letters: list[dict] | None = None,
    ) -> None:
        """Send each entry's reply (if any), acknowledge and delete the entries, and append refused
        packets' records to the dead-letter stream: one round trip. A reply or dead letter Redis refuses (a
        stream someone wedged with the last possible entry id, an ACL without the command) fails nothing else:
        it is logged once per stream and the entries are acknowledged all the same."""
        pipe = self.r.pipeline(transaction=False)
        lenient: list[str | None] = []  # per queued command: the stream whose refusal is only logged
        for record in dead_letters or []:
            pipe.xadd(self.dead_stream, record, maxlen=self.settings.relay.dead_letter_maxlen, approximate=True)
            lenient.append(self.dead_stream)
        acked: set[tuple[bytes | str, bytes]] = set()
        for stream, entry_id, reply in done:  # a group entry comes once per session it holds: acked once
            if reply is not None:  # a head's stream holds every session's: capped as a request stream
                add_reply(pipe, reply, self.settings.relay.request_stream_maxlen)
                lenient.append(reply.stream)
            if (stream, entry_id) not in acked:
                acked.add((stream, entry_id))
                pipe.xack(stream, self.group, entry_id)
                pipe.xdel(stream, entry_id)
                lenient += [None, None]
        for result, where in zip(pipe.execute(raise_on_error=False), lenient, strict=True):
            if isinstance(result, Exception):
                if where is None or not isinstance(result, redis.ResponseError):
                    raise result
                self._refused_write(where, result)

    def _refused_write(self, stream: str, e: redis.ResponseError) -> None:
        """Say once per stream (of the last 1,024) that Redis refuses writes there; go on."""
        if stream in self._refusals:
            return
        if len(self._refusals) >= 1024:
            self._refusals.clear()
        self._refusals.add(stream)
        log.warning("cannot write to %s (%s): its entries are dropped; going on", stream, e)
