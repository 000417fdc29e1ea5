"""The head's sender threads (workers/head/relay_io.py): an item whose entries cannot be built fails alone, with
its `on_error`, and the threads go on publishing."""

from __future__ import annotations

import secrets
import threading

from schemas.settings import Settings
from workers.head.relay_io import Outgoing, Sender


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
