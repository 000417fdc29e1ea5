"""A running head announces itself and keeps its reply stream: `{prefix}:head:{name}` holds its boot id and expires
after its reply timeout unless renewed, and `{prefix}:reply:head.{name}.{boot}` (one per key prefix) is where tails
put every verdict for its sessions. Tails read the key (workers/tail/liveness.py) to free the sessions of a head that
died or restarted without waiting for their idle expiry. One daemon thread per key prefix a head talks to; its first
write happens before the head sends any round, so a tail never sees a live head without its key and its stream.

The reply stream is the head's alone to make, read (through its own consumer group, `reply_group`), expire and drop:
tails only append to it, and never make it (XADD NOMKSTREAM: a reply to a stream that is gone is dropped). Each
period the beacon renews the key and the stream's expiry and looks at the stream's last entry id in one round trip.
An id no tail's automatic one can be (a day or more ahead of the clock: one `XADD ... 18446744073709551615-...`
makes every later reply fail) or a stream that is gone moves the head to a fresh stream, a new epoch in its name
(`head.{name}.{boot}.{epoch}`, `Keys.head_reply_to`), which its next rounds name; its step loop moves its generations
there (workers/head/loop.py) and the rounds whose replies were lost are replayed after the reply timeout.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time

import redis

from relay_broker.connection import transport_retry
from relay_broker.streams import make_reply_stream
from schemas.errors import TransportError
from schemas.keys import Keys
from schemas.packets import HeadRef
from schemas.settings import Settings

log = logging.getLogger("shardflow.head")
FAR_AHEAD_MS = 86_400_000  # a reply stream's last id this far past Redis's clock is no tail's: a wedged stream


def default_head_name() -> str:
    return f"{head_name(socket.gethostname())[:32]}-{os.getpid()}-{secrets.token_hex(3)}"


def head_name(name: str) -> str:
    """`name` as a head's name on the wire (letters, digits and -_.: kept, the rest as '-'; 96 at most)."""
    return "".join(c if (c.isalnum() and c.isascii()) or c in "-_.:" else "-" for c in name)[:96] or "head"


def reply_group(ref: HeadRef) -> str:
    """The consumer group one head process reads its reply streams through: its own (by its boot id), so no other
    head's reads take its verdicts even where heads share one Redis user."""
    return f"head.{ref.boot}"


class HeadBeacon:
    """Keeps one head's liveness key set and its reply stream alive while the process runs (a daemon thread)."""

    def __init__(self, r: redis.Redis, names: Keys, ref: HeadRef, settings: Settings) -> None:
        self.r, self.names, self.key, self.ref = r, names, names.head(ref.name), ref
        self.period_s = max(min(settings.jobs.heartbeat_s, ref.reply_timeout_s / 4), 0.05)
        self.ttl_ms = max(int(ref.reply_timeout_s * 1000), int(self.period_s * 3000))
        self.stream_ttl_s = settings.relay.reply_ttl_s
        self.epoch = 0
        self.reply_to = Keys.head_reply_to(ref.name, ref.boot)
        self.stop = threading.Event()
        self._announce()  # before the first round goes out
        self.thread = threading.Thread(target=self._run, name=f"head-beacon-{names.prefix}", daemon=True)
        self.thread.start()

    @transport_retry()
    def _announce(self) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.set(self.key, self.ref.boot, px=self.ttl_ms)
        make_reply_stream(pipe, self.names.reply(self.reply_to), reply_group(self.ref), self.stream_ttl_s)
        for reply in pipe.execute(raise_on_error=False):
            if isinstance(reply, Exception) and "BUSYGROUP" not in str(reply):
                raise reply

    def _run(self) -> None:
        failing = False
        while not self.stop.wait(self.period_s):
            try:  # one try a period (no transport retries: the next period is the retry)
                self._renew()
                failing = False
            except (TransportError, redis.RedisError) as e:  # tails may free our sessions: replays follow
                (log.debug if failing else log.warning)("head %s: could not renew %s: %s", self.ref.name, self.key, e)
                failing = True

    def _renew(self) -> None:
        """The key and the stream's expiry renewed and the stream's last id read: one round trip; a wedged or
        vanished stream is left for a fresh one."""
        stream = self.names.reply(self.reply_to)
        pipe = self.r.pipeline(transaction=False)
        pipe.set(self.key, self.ref.boot, px=self.ttl_ms)
        pipe.expire(stream, self.stream_ttl_s)
        pipe.xrevrange(stream, count=1)
        _, kept, last = pipe.execute()
        wedged = bool(last) and int(last[0][0].split(b"-")[0]) > time.time() * 1000 + FAR_AHEAD_MS
        if wedged or not kept:
            self._next_epoch("its last entry id is past any a tail can add" if wedged else "it is gone")

    def _next_epoch(self, why: str) -> None:
        epoch = self.epoch + 1
        reply_to = Keys.head_reply_to(self.ref.name, self.ref.boot, epoch)
        pipe = self.r.pipeline(transaction=False)
        make_reply_stream(pipe, self.names.reply(reply_to), reply_group(self.ref), self.stream_ttl_s)
        for reply in pipe.execute(raise_on_error=False):
            if isinstance(reply, Exception) and "BUSYGROUP" not in str(reply):
                raise reply
        log.warning("head %s: reply stream %s: %s; replies now come on %s", self.ref.name, self.reply_to, why, reply_to)
        self.reply_to, self.epoch = reply_to, epoch

    def close(self) -> None:
        """Stop renewing and delete the key (a head that stops cleanly frees its sessions at once)."""
        self.stop.set()
        try:
            if self.r.get(self.key) == self.ref.boot.encode():
                self.r.delete(self.key)
        except redis.RedisError:
            pass


class Beacons:
    """A head's beacons, one per key prefix (created on first use, shared by every generation)."""

    def __init__(self, name: str | None, settings: Settings) -> None:
        self.settings = settings
        self.ref = HeadRef(
            name=name or default_head_name(), boot=secrets.token_hex(8), reply_timeout_s=settings.relay.reply_timeout_s
        )
        self._by_prefix: dict[str, HeadBeacon] = {}
        self._lock = threading.Lock()

    def rename(self, name: str) -> None:
        """Take the worker's name (kept as it is once a generation announced the head under its first one)."""
        with self._lock:
            if not self._by_prefix:
                self.ref = self.ref.model_copy(update={"name": head_name(name)})

    def ensure(self, r: redis.Redis, names: Keys) -> HeadRef:
        """This head's identity, announced under `names`' prefix."""
        with self._lock:
            if names.prefix not in self._by_prefix:
                self._by_prefix[names.prefix] = HeadBeacon(r, names, self.ref, self.settings)
        return self.ref

    def reply_to(self, names: Keys) -> str:
        """The reply stream (its suffix) this head's rounds under `names`' prefix name now (ensured first)."""
        return self._by_prefix[names.prefix].reply_to

    @property
    def epochs(self) -> int:
        """How many times this head moved to a fresh reply stream, over every prefix (a change: look again)."""
        return sum(b.epoch for b in list(self._by_prefix.values()))

    def close(self) -> None:
        with self._lock:
            for beacon in self._by_prefix.values():
                beacon.close()
            self._by_prefix.clear()
