"""The head's Redis I/O beside its step loop (workers/head/loop.py): one thread sends, one receives, so the loop
never waits on a round trip (over a WAN link one costs the whole link's latency).

- `Sender` publishes what the loop queues (a group's round entries, close packets, dead letters), all that is
  queued at once in one pipeline, and tells the loop which sends failed.
- `Receiver` blocks reading the head's own reply streams (`reply:head.NAME.BOOT`, one per key prefix), where
  tails put every reply to its sessions (a batch's replies in one entry, schemas/groups.py), and hands the
  loop each reply with the session it names. What is not a reply container is dead-lettered.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from relay_broker.streams import publish_many
from schemas.errors import PacketError
from schemas.groups import is_group, unpack_group
from schemas.packets import DeadLetterRecord, decode_tail_message
from schemas.peek import peek_session, raw_header
from schemas.settings import Settings

log = logging.getLogger("shardflow.head")


@dataclass
class Outgoing:
    """Stream entries to publish (and dead-letter records for `dead_stream`), with what to call if they fail."""

    entries: list[tuple[str, dict]]
    dead: list[tuple[str, dict]] = field(default_factory=list)  # (dead-letter stream, record fields)
    on_error: Callable[[BaseException], None] | None = None


class Sender:
    def __init__(self, r: redis.Redis, settings: Settings) -> None:
        self.r, self.settings = r, settings
        self._q: queue.Queue[Outgoing] = queue.Queue()
        threading.Thread(target=self._run, daemon=True, name="head-sender").start()

    def put(self, out: Outgoing) -> None:
        self._q.put(out)

    def _run(self) -> None:
        while True:
            batch = [self._q.get()]
            while not self._q.empty():
                batch.append(self._q.get_nowait())
            entries = [e for out in batch for e in out.entries]
            dead = [d for out in batch for d in out.dead]
            try:
                publish_many(
                    self.r,
                    entries,
                    maxlen=self.settings.request_stream_maxlen,
                    dead=dead,
                    dead_maxlen=self.settings.dead_letter_maxlen,
                )
            except BaseException as e:  # a transport error past its retries: these sends fail
                log.warning("head: could not publish %d entries: %s", len(entries), e)
                for out in batch:
                    if out.on_error is not None:
                        out.on_error(e)


Reply = tuple[str | None, bytes, dict]  # (session it names, entry id, its fields)


class Receiver:
    def __init__(self, r: redis.Redis, settings: Settings, deliver: Callable[[list[Reply]], None], sender: Sender):
        self.r, self.settings, self.deliver, self.sender = r, settings, deliver, sender
        self._streams: dict[str, tuple[bytes, str]] = {}  # reply stream -> (last id read, dead-letter stream)
        self._users: dict[str, int] = {}  # generations waiting on each stream
        self._left: dict[str, bytes] = {}  # where a stream no longer read was left
        self._cv = threading.Condition()
        threading.Thread(target=self._run, daemon=True, name="head-receiver").start()

    def watch(self, stream: str, dead_stream: str) -> None:
        """Read `stream` (from where it was left, else from its start: a head's reply streams are its own, named
        by its boot id) while a generation waits on it."""
        with self._cv:
            self._users[stream] = self._users.get(stream, 0) + 1
            if stream not in self._streams:
                self._streams[stream] = (self._left.pop(stream, b"0-0"), dead_stream)
                self._cv.notify()

    def unwatch(self, stream: str) -> None:
        """One generation on `stream` ended; with none left the stream is no longer read (an idle head reads
        nothing)."""
        with self._cv:
            self._users[stream] = self._users.get(stream, 1) - 1
            if self._users[stream] <= 0 and stream in self._streams:
                self._left[stream] = self._streams.pop(stream)[0]
                del self._users[stream]

    def _run(self) -> None:
        failing = False
        while True:
            with self._cv:
                while not self._streams:
                    self._cv.wait()
                streams = dict(self._streams)
            try:
                resp = self.r.xread(
                    {s: last for s, (last, _) in streams.items()}, count=1000, block=self.settings.block_ms
                )
            except redis.RedisError as e:  # Redis away: ridden out (the generations time out and replay)
                (log.debug if failing else log.warning)("head: reading replies failed (%s); retrying", e)
                failing = True
                time.sleep(self.settings.reconnect_min_s)
                continue
            failing = False
            try:
                got = self._take(streams, resp)
            except Exception:  # an entry no check foresaw: never the end of the head's replies
                log.exception("head: a reply entry could not be read; skipped")
                continue
            if got:
                self.deliver(got)

    def _take(self, streams: dict[str, tuple[bytes, str]], resp: list | None) -> list[Reply]:
        got: list[Reply] = []
        for raw_stream, entries in resp or []:
            stream = raw_stream.decode() if isinstance(raw_stream, bytes) else raw_stream
            if not entries or stream not in streams:
                continue
            with self._cv:
                if stream in self._streams:
                    self._streams[stream] = (entries[-1][0], streams[stream][1])
                else:
                    self._left[stream] = entries[-1][0]
            for entry_id, fields in entries:
                got += self._parts(stream, streams[stream][1], entry_id, fields)
        return got

    def _parts(self, stream: str, dead_stream: str, entry_id: bytes, fields: dict) -> list[Reply]:
        """The replies an entry holds, each with the session it names. What names no session at all (junk, a
        malformed container) is dead-lettered here; a reply naming a session goes to that session's generation,
        which checks it (one for a session no longer in flight, a late duplicate say, is dropped)."""
        try:
            parts = unpack_group(fields, max_bytes=self.settings.max_packet_bytes) if is_group(fields) else [fields]
        except PacketError as e:
            self._refuse(stream, dead_stream, entry_id, fields, str(e))
            return []
        out: list[Reply] = []
        for part in parts:
            sid = peek_session(part)[0]
            if sid is None:
                self._refuse(stream, dead_stream, entry_id, part, _why(part))
            else:
                out.append((sid, entry_id, part))
        return out

    def _refuse(self, stream: str, dead_stream: str, entry_id: bytes, fields: dict, reason: str) -> None:
        record = DeadLetterRecord(
            stream=stream,
            entry_id=entry_id.decode(),
            reason=f"head refused a reply: {reason}",
            refused_by="head",
            header=raw_header(fields),
            at=time.time(),
        ).fields()
        self.sender.put(Outgoing([], dead=[(dead_stream, record)]))


def _why(fields: dict) -> str:
    """Why an entry naming no session is no reply (what decoding it says)."""
    try:
        decode_tail_message(fields)
    except PacketError as e:
        return str(e)
    return "a reply naming no session"
