"""A running head announces itself: `{prefix}:head:{name}` holds its boot id and expires after its reply
timeout unless renewed. Tails read it (workers/tail/liveness.py) to free the sessions of a head that died
(the key expires) or restarted under the same name (the key names another boot) without waiting for their
idle expiry. One daemon thread per key prefix a head talks to; its first write happens before the head
sends any round, so a tail never sees a live head without its key.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading

import redis

from relay_broker.connection import transport_retry
from schemas.errors import TransportError
from schemas.keys import Keys
from schemas.packets import HeadRef
from schemas.settings import Settings

log = logging.getLogger("shardflow.head")


def default_head_name() -> str:
    return f"{head_name(socket.gethostname())[:32]}-{os.getpid()}-{secrets.token_hex(3)}"


def head_name(name: str) -> str:
    """`name` as a head's name on the wire (letters, digits and -_.: kept, the rest as '-'; 96 at most)."""
    return "".join(c if (c.isalnum() and c.isascii()) or c in "-_.:" else "-" for c in name)[:96] or "head"


class HeadBeacon:
    """Keeps one head's liveness key set while the process runs (a daemon thread)."""

    def __init__(self, r: redis.Redis, names: Keys, ref: HeadRef, settings: Settings) -> None:
        self.r, self.key, self.ref = r, names.head(ref.name), ref
        self.period_s = max(min(settings.jobs.heartbeat_s, ref.reply_timeout_s / 4), 0.05)
        self.ttl_ms = max(int(ref.reply_timeout_s * 1000), int(self.period_s * 3000))
        self.stop = threading.Event()
        self._announce()  # before the first round goes out
        self.thread = threading.Thread(target=self._run, name=f"head-beacon-{names.prefix}", daemon=True)
        self.thread.start()

    @transport_retry()
    def _announce(self) -> None:
        self.r.set(self.key, self.ref.boot, px=self.ttl_ms)

    def _run(self) -> None:
        failing = False
        while not self.stop.wait(self.period_s):
            try:  # one try a period (no transport retries: the next period is the retry)
                self.r.set(self.key, self.ref.boot, px=self.ttl_ms)
                failing = False
            except (TransportError, redis.RedisError) as e:  # tails may free our sessions: replays follow
                (log.debug if failing else log.warning)("head %s: could not renew %s: %s", self.ref.name, self.key, e)
                failing = True

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

    def close(self) -> None:
        with self._lock:
            for beacon in self._by_prefix.values():
                beacon.close()
            self._by_prefix.clear()
