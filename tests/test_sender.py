"""The head's sender threads (workers/head/relay_io.py): an item whose entries cannot be built fails alone, with
its `on_error`, and the threads go on publishing; large fields go to Redis uncopied and arrive whole."""

from __future__ import annotations

import secrets
import threading

from relay_broker.streams import publish_many
from schemas.macs import authentic, session_key
from schemas.settings import Settings
from workers.head.relay_io import Outgoing, Sender
from workers.head.sealing import VIEW_BYTES, entries

KEY = session_key()


def test_a_build_that_fails_fails_its_item_and_the_sender_goes_on(redis_client) -> None:
    sender = Sender(redis_client, Settings(relay={"head_senders": 1}))
    stream, failed = f"sender-{secrets.token_hex(4)}", threading.Event()

    def broken() -> list:
        raise ValueError("cannot build")

    sender.put(Outgoing([], on_error=lambda e: failed.set(), build=broken))
    assert failed.wait(10)
    sent = threading.Event()
    sender.put(Outgoing([], on_error=lambda e: None, build=lambda: [(stream, {b"h": b"x"})]))
    for _ in range(100):
        if redis_client.xlen(stream):
            sent.set()
            break
        threading.Event().wait(0.05)
    assert sent.is_set()


def test_large_fields_go_as_views_and_arrive_whole(redis_client) -> None:
    """A group entry's large fields are sent as memoryviews (redis-py writes them uncopied): Redis holds the same
    bytes, and the small ones stay bytes."""
    big, small = secrets.token_bytes(VIEW_BYTES + 3), b"header"
    stream = f"sender-{secrets.token_hex(4)}"
    ((to, fields),), (mac,) = entries([(stream, KEY, {b"h": small, b"t.hidden": big})], Settings().relay)
    assert isinstance(fields[b"t.hidden"], memoryview) and isinstance(fields[b"h"], bytes)
    publish_many(redis_client, [(to, fields)], maxlen=10)
    ((_, got),) = redis_client.xrange(stream)
    assert got == {b"h": small, b"t.hidden": big, b"m": mac} and authentic(KEY, got)
