"""The relay operations on Redis streams: publish, consume through a group, ack, reply, trim, dead-letter.

Key names are in schemas/keys.py.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

import redis

from relay_broker.budgets import ReadBudget, entry_bytes
from relay_broker.connection import transport_retry
from schemas.errors import ReplyTimeout
from schemas.groups import MAC_BYTES, pack_group
from schemas.keys import Keys
from schemas.packets import MAC
from schemas.peek import head_batch_incomplete
from schemas.settings import Settings

Entry = tuple[bytes, bytes, dict[bytes, bytes]]  # (stream, entry id, fields)
log = logging.getLogger("shardflow.relay")


@transport_retry()
def publish(r: redis.Redis, stream: str, fields: dict, *, maxlen: int) -> bytes:
    """Append one entry to `stream`, trimming it to about `maxlen` entries (a request stream:
    settings.relay.request_stream_maxlen)."""
    return r.xadd(stream, fields, maxlen=maxlen, approximate=True)


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
    """A reply for one session's stream (or, `shared`, for the stream where a head reads all its sessions'
    replies); the stream expires ttl_s after it (a session's last verdict expires sooner: its head reads it at
    once and deletes nothing)."""

    stream: str
    fields: dict
    ttl_s: int
    shared: bool = False


def merge_replies(done: list[tuple[bytes | str, bytes, Reply | None]]) -> list[tuple[bytes | str, bytes, Reply | None]]:
    """The same acks with the replies bound for one head's shared stream packed into one entry (schemas/groups.py;
    an unsigned reply gets an all-zero MAC, which never verifies), carried by the first of them."""
    shared: dict[str, list[int]] = {}
    for i, (_, _, reply) in enumerate(done):
        if reply is not None and reply.shared:
            shared.setdefault(reply.stream, []).append(i)
    out = list(done)
    for stream, at in shared.items():
        if len(at) < 2:
            continue
        replies = [done[i][2] for i in at]
        parts = [{MAC: bytes(MAC_BYTES), **r.fields} for r in replies]  # type: ignore[union-attr]
        packed = Reply(stream, pack_group(parts), max(r.ttl_s for r in replies), True)  # type: ignore[union-attr]
        for n, i in enumerate(at):
            out[i] = (done[i][0], done[i][1], packed if n == 0 else None)
    return out


def make_reply_stream(pipe: redis.client.Pipeline, stream: str, group: str, ttl_s: int) -> None:
    """Queue what makes a head's reply stream: its consumer group (from the start, the stream made with it; a
    BUSYGROUP answer means it is there already) and its expiry."""
    pipe.xgroup_create(stream, group, id="0", mkstream=True)
    pipe.expire(stream, ttl_s)


def add_reply(pipe: redis.client.Pipeline, reply: Reply, maxlen: int) -> int:
    """Queue a reply, kept to about `maxlen` entries; how many commands were queued. A session's own stream is made
    if missing and expires when abandoned; a head's shared stream is its head's alone to make and keep alive
    (workers/head/beacon.py): a reply to one that is gone (its head stopped, or moved to a fresh stream) is
    dropped, never made again without an expiry."""
    if reply.shared:
        pipe.xadd(reply.stream, reply.fields, maxlen=maxlen, approximate=True, nomkstream=True)
        return 1
    pipe.xadd(reply.stream, reply.fields, maxlen=maxlen, approximate=True)
    pipe.expire(reply.stream, reply.ttl_s)
    return 2


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
        """With a linger (a CPU tail): while fewer rounds are read than sessions are open, read more as long as
        they keep coming, each within the linger of the last (at most 4 reads): a head's threads publish the
        rounds of one batch one by one, and without the wait the first would run alone and the rest after it.
        While a head batch's hint (`head_batch`) says rounds of it are still to come (sent together, a large
        batch's packets still arrive spread out), it waits for them; never more than 50 lingers in all (a
        round of the batch that another tail took, or a hint that lies, costs that much at most)."""
        if not entries or linger_ms <= 0:
            return entries
        deadline, reads = time.monotonic() + 50 * linger_ms / 1000, 0
        held = sum(entry_bytes(fields) for _, _, fields in entries)
        while len(entries) < slots and held < self.budget.max_bytes:  # the byte budget holds for the whole batch
            missing = head_batch_incomplete([fields for _, _, fields in entries])
            if not missing and (reads >= 4 or len(entries) >= min(open_sessions, slots)):
                break
            left_ms = (deadline - time.monotonic()) * 1000
            if left_ms < 1:
                break
            block_ms = max(int(left_ms if missing else min(left_ms, linger_ms)), 1)  # 0 would block for good
            more = self.read(count=slots - len(entries), block_ms=block_ms)
            reads += 1
            if not more:
                break
            entries = entries + more
            held += sum(entry_bytes(fields) for _, _, fields in more)
        return entries

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
            if reply is not None:  # a head's shared stream holds every session's: capped as a request stream
                cap = (
                    self.settings.relay.request_stream_maxlen
                    if reply.shared
                    else self.settings.relay.reply_stream_maxlen
                )
                lenient += [reply.stream] * add_reply(pipe, reply, cap)
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


@dataclass
class ReplyReader:
    """Reads one session's reply stream in order, remembering where it stopped.

    Anyone who can write the stream (a tail, or any client of a Redis without ACLs) can put entries in it,
    so the caller checks each one and hands the bad ones back with `refuse`: they go to the dead-letter
    stream in the same round trip as the next read (at most `reply_dead_letters_max` records per reader; the
    rest are only counted). Entries are read `reply_read_count` at a time, so a flood of junk costs one round
    trip per that many entries and holds at most that many in memory."""

    r: redis.Redis
    stream: str
    last_id: bytes = b"0-0"
    dead_stream: str | None = None
    settings: Settings = field(default_factory=Settings)  # reply_read_count, reply_dead_letters_max, block_ms
    entry_id: bytes = field(default=b"", init=False)  # id of the entry `next` returned last
    refused: int = field(default=0, init=False)
    _buffer: deque = field(default_factory=deque, init=False, repr=False)
    _dead: list[dict] = field(default_factory=list, init=False, repr=False)

    def next(self, timeout_s: float) -> dict[bytes, bytes]:
        """Return the next reply's fields; raise ReplyTimeout if none comes within timeout_s."""
        deadline = time.monotonic() + timeout_s
        while not self._buffer:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                raise ReplyTimeout(f"no reply on {self.stream} within {timeout_s:.1f}s")
            self._take(self._read(min(left_ms, self.settings.redis.block_ms)))
        return self._pop()

    def publish_then_next(self, stream: str, fields: dict, timeout_s: float) -> dict[bytes, bytes]:
        """Send a request and wait for the next reply in one round trip (XADD + blocking XREAD pipelined)."""
        deadline = time.monotonic() + timeout_s
        self._take(self._publish_and_read(stream, fields, min(int(timeout_s * 1000), self.settings.redis.block_ms)))
        return self._pop() if self._buffer else self.next(max(deadline - time.monotonic(), 0.0))

    @property
    def ready(self) -> bool:
        """An entry is buffered (`pop` returns it without a read)."""
        return bool(self._buffer)

    def pop(self) -> dict[bytes, bytes]:
        """The next buffered entry's fields (`ready` must be true)."""
        return self._pop()

    def refuse(self, record: dict) -> None:
        """Dead-letter the entry `next` returned last (`record`: its DeadLetterRecord fields)."""
        self.refused += 1
        if self.dead_stream is not None and self.refused <= self.settings.relay.reply_dead_letters_max:
            self._dead.append(record)

    def take_dead(self) -> list[dict]:
        """The dead letters queued so far (the caller sends them)."""
        dead, self._dead = self._dead, []
        return dead

    @transport_retry()
    def flush(self) -> None:
        """Send the dead letters still queued (the session ended before another read)."""
        if self._dead:
            pipe = self.r.pipeline(transaction=False)
            self._queue_dead(pipe)
            pipe.execute(raise_on_error=False)
            self._dead.clear()

    def _take(self, resp: list | None) -> None:
        for _, entries in resp or []:
            self._buffer.extend(entries)
        if self._buffer:
            self.last_id = self._buffer[-1][0]

    def _pop(self) -> dict[bytes, bytes]:
        self.entry_id, fields = self._buffer.popleft()
        return fields

    def _queue_dead(self, pipe: redis.client.Pipeline) -> int:
        """Queue the dead letters on `pipe` (a refused write, under an old ACL file say, fails nothing else)."""
        for record in self._dead:
            pipe.xadd(self.dead_stream, record, maxlen=self.settings.relay.dead_letter_maxlen, approximate=True)
        return len(self._dead)

    @transport_retry()
    def _publish_and_read(self, stream: str, fields: dict, block_ms: int) -> list:
        pipe = self.r.pipeline(transaction=False)
        n = self._queue_dead(pipe)
        pipe.xadd(stream, fields, maxlen=self.settings.relay.request_stream_maxlen, approximate=True)
        pipe.xread({self.stream: self.last_id}, count=self.settings.relay.reply_read_count, block=max(block_ms, 1))
        return self._result(pipe.execute(raise_on_error=False), n)

    @transport_retry()
    def _read(self, block_ms: int) -> list:
        pipe = self.r.pipeline(transaction=False)
        n = self._queue_dead(pipe)
        pipe.xread({self.stream: self.last_id}, count=self.settings.relay.reply_read_count, block=block_ms)
        return self._result(pipe.execute(raise_on_error=False), n)

    def _result(self, replies: list, dead: int) -> list:
        """The XREAD's answer; an error of the commands after the `dead` dead-letter writes raises (sent
        dead letters are dropped only now: a transport retry sends them again)."""
        self._dead.clear()
        for reply in replies[dead:]:
            if isinstance(reply, Exception):
                raise reply
        return replies[-1]


@transport_retry()
def read_replies(r: redis.Redis, readers: list[ReplyReader], *, block_ms: int | None, count: int) -> None:
    """One round trip for many sessions' reply streams: every reader's queued dead letters, then one XREAD
    from where each stopped (blocking up to block_ms; None: not at all); the entries land in each reader's
    buffer (`ready`, `pop`)."""
    pipe = r.pipeline(transaction=False)
    dead = sum(reader._queue_dead(pipe) for reader in readers)
    pipe.xread({reader.stream: reader.last_id for reader in readers}, count=count, block=block_ms)
    replies = pipe.execute(raise_on_error=False)
    for reader in readers:
        reader._dead.clear()
    for reply in replies[dead:]:
        if isinstance(reply, Exception):
            raise reply
    by_stream = {reader.stream.encode(): reader for reader in readers}
    for stream, entries in replies[-1] or []:
        if (reader := by_stream.get(stream)) is not None and entries:
            reader._buffer.extend(entries)
            reader.last_id = entries[-1][0]
