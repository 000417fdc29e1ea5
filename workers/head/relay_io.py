"""The head's Redis I/O beside its step loop (workers/head/loop.py): a few threads send, a few receive, so the loop
never waits on a round trip (over a WAN link one costs the whole link's latency).

- `Sender` publishes what the loop queues (a group's round entries, close packets, dead letters) on
  `relay.head_senders` threads, each taking all that is queued at once in one pipeline of its own connection: a group
  computed while another's publish is on the wire goes at once rather than a round trip later. Entries of one
  session never overtake each other: a session has one round on the wire at a time, and its close packet goes
  after its last verdict came.
- `Receiver` reads the head's own reply streams (`reply:head.NAME.BOOT[.EPOCH]`, one per key prefix, made and kept
  by workers/head/beacon.py), where tails put every reply to its sessions (a batch's replies in one entry,
  schemas/groups.py), through the head's own consumer group (`reply_group`) on `relay.head_readers` threads: each
  entry goes to one of them, and while one reader's answer travels back another's read already waits at Redis, so
  a reply is taken as it comes (with one blocking XREAD, a reply written while the answer to the last read travels
  waits for the next read to arrive: up to one more round trip). A read takes at most about
  `relay.read_max_bytes` (relay_broker/budgets.py). The loop gets each reply with the session it names; what is not
  a reply container is dead-lettered, at most `relay.dead_letter_rate` a second per stream.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from relay_broker.budgets import DeadLetterCap, ReadBudget
from relay_broker.streams import make_reply_stream, publish_many
from schemas.dead_letters import dead_letter
from schemas.errors import PacketError
from schemas.groups import entry_parts
from schemas.packets import decode_tail_message
from schemas.peek import peek_session
from schemas.settings import RelaySettings, Settings
from workers.drain import take_queued
from workers.head.link import LinkMeter
from workers.phases import PhaseClock

log = logging.getLogger("shardflow.head")


@dataclass
class Outgoing:
    """Stream entries to publish (and dead-letter records for `dead_stream`), with what to call if they fail.
    `build`, if set, makes more entries on the sender's thread just before they go (a group's rounds are sealed
    there, off the step loop); if it raises, `on_error` hears it and nothing of the item goes."""

    entries: list[tuple[str, dict]]
    dead: list[tuple[str, dict]] = field(default_factory=list)  # (dead-letter stream, record fields)
    on_error: Callable[[BaseException], None] | None = None
    build: Callable[[], list[tuple[str, dict]]] | None = None
    rows: int = 0  # hidden rows in what it publishes (the link meter's bytes per row)
    queued: float = field(default_factory=time.perf_counter)  # when it was put (the sender's clock: "queued")


class Sender:
    """`clock`, if given, hears how long a group waited for a sender ("queued") and how long its publish took
    ("publish": one round trip, the bytes through the link and Redis); `meter`, if given, each publish's bytes,
    rows and times (workers/head/link.py: the link's bandwidth and round trip, from the head's own traffic)."""

    def __init__(
        self, r: redis.Redis, settings: Settings, clock: PhaseClock | None = None, meter: LinkMeter | None = None
    ) -> None:
        self.r, self.settings, self.clock, self.meter = r, settings, clock, meter
        self._q: queue.Queue[Outgoing] = queue.Queue()
        for i in range(max(settings.relay.head_senders, 1)):
            threading.Thread(target=self._run, daemon=True, name=f"head-sender-{i}").start()

    def put(self, out: Outgoing) -> None:
        self._q.put(out)

    def _run(self) -> None:
        while True:
            self._publish(take_queued(self._q))

    @staticmethod
    def _built(batch: list[Outgoing]) -> list[Outgoing]:
        """Each item with its `build`'s entries added; one whose build fails gets its `on_error`, and goes
        unsent (the sender thread goes on)."""
        out: list[Outgoing] = []
        for item in batch:
            if item.build is not None:
                try:
                    item = Outgoing([*item.entries, *item.build()], item.dead, item.on_error, rows=item.rows)
                except Exception as e:
                    log.exception("head: could not build entries to publish")
                    if item.on_error is not None:
                        item.on_error(e)
                    continue
            out.append(item)
        return out

    def _publish(self, batch: list[Outgoing]) -> None:
        if self.clock is not None:
            now = time.perf_counter()
            for item in batch:
                if item.build is not None:
                    self.clock.add("queued", now - item.queued)
        built = self._built(batch)
        entries = [e for out in built for e in out.entries]
        dead = [d for out in built for d in out.dead]
        t0 = time.perf_counter()
        try:
            publish_many(
                self.r,
                entries,
                maxlen=self.settings.relay.request_stream_maxlen,
                dead=dead,
                dead_maxlen=self.settings.relay.dead_letter_maxlen,
            )
            t1 = time.perf_counter()
            if self.clock is not None and len(entries) > 0:
                self.clock.add("publish", t1 - t0)
            if self.meter is not None and entries:
                nbytes = sum(len(v) for _, fields in entries for v in fields.values())
                self.meter.note_publish(t0, t1, nbytes, sum(out.rows for out in built))
        except BaseException as e:  # a transport error past its retries: these sends fail
            log.warning("head: could not publish %d entries: %s", len(entries), e)
            for out in built:
                if out.on_error is not None:
                    out.on_error(e)


Reply = tuple[str | None, bytes, dict]  # (session it names, entry id, its fields)


class Receiver:
    """`group`: the head's own consumer group (workers/head/beacon.py `reply_group`); `dead_cap`: the head's cap on
    dead letters (shared with its loop, which counts them in its phase lines)."""

    def __init__(
        self,
        r: redis.Redis,
        settings: Settings,
        deliver: Callable[[list[Reply]], None],
        sender: Sender,
        *,
        group: str,
        dead_cap: DeadLetterCap,
    ) -> None:
        self.r, self.settings, self.deliver, self.sender = r, settings, deliver, sender
        self.group, self.dead_cap = group, dead_cap
        self.budget = ReadBudget(settings.relay.read_max_bytes, settings.relay.max_packet_bytes)
        self._streams: dict[str, str] = {}  # reply stream read -> its dead-letter stream
        self._users: dict[str, int] = {}  # generations waiting on each stream
        self._grouped: set[str] = set()  # streams whose consumer group this head made (or found)
        self._cv = threading.Condition()
        for i in range(max(settings.relay.head_readers, 1)):
            threading.Thread(target=self._run, args=(f"r{i}",), daemon=True, name=f"head-receiver-{i}").start()

    def watch(self, stream: str, dead_stream: str) -> None:
        """Read `stream` while a generation waits on it (from its start the first time: a head's reply streams
        are its own, named by its boot id; later from where the group left it)."""
        with self._cv:
            self._users[stream] = self._users.get(stream, 0) + 1
            if stream not in self._streams:
                self._streams[stream] = dead_stream
                self._cv.notify_all()

    def unwatch(self, stream: str) -> None:
        """One generation on `stream` ended; with none left the stream is no longer read (an idle head reads
        nothing)."""
        with self._cv:
            self._users[stream] = self._users.get(stream, 1) - 1
            if self._users[stream] <= 0 and stream in self._streams:
                del self._streams[stream], self._users[stream]

    def _run(self, consumer: str) -> None:
        failing = False
        while True:
            with self._cv:
                while not self._streams:
                    self._cv.wait()
                streams = dict(self._streams)
            try:
                self._groups(streams)
                resp = self.r.xreadgroup(
                    self.group,
                    consumer,
                    dict.fromkeys(streams, ">"),
                    count=self.budget.count(1000),
                    block=self.settings.redis.block_ms,
                    noack=True,
                )
                self.budget.saw(f for _, entries in resp or [] for _, f in entries if f)
            except redis.ResponseError as e:  # NOGROUP: a stream expired and came back without its group
                with self._cv:
                    self._grouped.difference_update(streams)
                (log.debug if "NOGROUP" in str(e) else log.warning)(
                    "head: reading replies: %s; making the groups again", e
                )
                if "NOGROUP" not in str(e):  # refused (an ACL without XGROUP, say): not a hot loop
                    time.sleep(self.settings.redis.reconnect_min_s)
                continue
            except redis.RedisError as e:  # Redis away: ridden out (the generations time out and replay)
                (log.debug if failing else log.warning)("head: reading replies failed (%s); retrying", e)
                failing = True
                time.sleep(self.settings.redis.reconnect_min_s)
                continue
            failing = False
            try:
                got = self._take(streams, resp)
            except Exception:  # an entry no check foresaw: never the end of the head's replies
                log.exception("head: a reply entry could not be read; skipped")
                continue
            if got:
                self.deliver(got)

    def _groups(self, streams: dict[str, str]) -> None:
        """Make the consumer group of each stream not yet grouped (from its start; an empty stream made for it
        expires as a reply stream does; tails' replies renew it)."""
        with self._cv:
            new = [s for s in streams if s not in self._grouped]
        if not new:
            return
        pipe = self.r.pipeline(transaction=False)
        for stream in new:
            make_reply_stream(pipe, stream, self.group, self.settings.relay.reply_ttl_s)
        for reply in pipe.execute(raise_on_error=False):
            if isinstance(reply, redis.ResponseError) and "BUSYGROUP" not in str(reply):
                raise reply
            if isinstance(reply, Exception) and not isinstance(reply, redis.ResponseError):
                raise reply
        with self._cv:
            self._grouped.update(new)

    def _take(self, streams: dict[str, str], resp: list | None) -> list[Reply]:
        got: list[Reply] = []
        for raw_stream, entries in resp or []:
            stream = raw_stream.decode() if isinstance(raw_stream, bytes) else raw_stream
            if stream not in streams:
                continue
            for entry_id, fields in entries:
                if fields:  # (an entry trimmed away before it was read comes as an empty one)
                    got += self._parts(stream, streams[stream], entry_id, fields)
        return got

    def _parts(self, stream: str, dead_stream: str, entry_id: bytes, fields: dict) -> list[Reply]:
        """The replies an entry holds, each with the session it names. What names no session at all (junk, a
        malformed container) is dead-lettered here; a reply naming a session goes to that session's generation,
        which checks it (one for a session no longer in flight, a late duplicate say, is dropped)."""
        try:
            parts = entry_parts(fields, max_bytes=self.settings.relay.max_packet_bytes)
        except PacketError as e:
            self._refuse(stream, dead_stream, entry_id, fields, str(e))
            return []
        out: list[Reply] = []
        for part in parts:
            sid = peek_session(part)[0]
            if sid is None:
                self._refuse(stream, dead_stream, entry_id, part, _why(part, self.settings.relay))
            else:
                out.append((sid, entry_id, part))
        return out

    def _refuse(self, stream: str, dead_stream: str, entry_id: bytes, fields: dict, reason: str) -> None:
        if self.dead_cap.allow(stream):
            record = dead_letter(stream, entry_id, f"head refused a reply: {reason}", fields, refused_by="head")
            self.sender.put(Outgoing([], dead=[(dead_stream, record)]))


def _why(fields: dict, caps: RelaySettings) -> str:
    """Why an entry naming no session is no reply (what decoding it says)."""
    try:
        decode_tail_message(fields, caps=caps)
    except PacketError as e:
        return str(e)
    return "a reply naming no session"
