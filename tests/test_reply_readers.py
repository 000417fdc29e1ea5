"""The head's reply readers (workers/head/relay_io.py): a consumer group on several threads, so each reply is
taken once, and a reply stream that expired and came back (without its group) is read again from its start."""

from __future__ import annotations

import threading
import time
import uuid

from schemas.settings import Settings
from workers.head.relay_io import REPLY_GROUP, Outgoing, Receiver


class Collect:
    """Stands in for the head's Sender: what the receiver dead-letters lands here."""

    def __init__(self) -> None:
        self.dead: list[dict] = []
        self.event = threading.Event()

    def put(self, out: Outgoing) -> None:
        self.dead += [fields for _, fields in out.dead]
        self.event.set()


def wait_for(cond, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_each_entry_once_and_again_after_the_stream_expired(redis_client):
    stream, dead = f"t:{uuid.uuid4().hex}:reply:head.x.b", f"t:{uuid.uuid4().hex}:dead"
    sink = Collect()
    got: list = []
    rx = Receiver(redis_client, Settings(redis={"block_ms": 100}, relay={"head_readers": 3}), got.extend, sink)  # type: ignore[arg-type]
    rx.watch(stream, dead)
    assert wait_for(lambda: redis_client.exists(stream) and redis_client.xinfo_groups(stream))
    assert redis_client.xinfo_groups(stream)[0]["name"].decode() == REPLY_GROUP
    assert 0 < redis_client.ttl(stream) <= Settings().relay.reply_ttl_s  # the stream made for the group expires
    for i in range(20):  # junk names no session: each is dead-lettered once, whichever reader took it
        redis_client.xadd(stream, {"junk": str(i)})
    assert wait_for(lambda: len(sink.dead) >= 20)
    time.sleep(0.3)
    assert len(sink.dead) == 20 and got == []
    redis_client.delete(stream)  # expired: a tail's next reply makes the stream again, without the group
    redis_client.xadd(stream, {"junk": "after"})
    assert wait_for(lambda: len(sink.dead) == 21)
    rx.unwatch(stream)
