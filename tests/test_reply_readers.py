"""The head's reply readers (workers/head/relay_io.py): the head's own consumer group on several threads, so each
reply is taken once, a reply stream that expired and came back (without its group) is read again from its start, and
a flood of junk is dead-lettered at most at the capped rate (the rest counted)."""

from __future__ import annotations

import threading
import time
import uuid

from relay_broker.budgets import DeadLetterCap
from schemas.settings import Settings
from workers.head.relay_io import Outgoing, Receiver

GROUP = "head.0123456789abcdef"


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
    settings = Settings(redis={"block_ms": 100}, relay={"head_readers": 3})
    cap = DeadLetterCap(10, 100)
    rx = Receiver(redis_client, settings, got.extend, sink, group=GROUP, dead_cap=cap)  # type: ignore[arg-type]
    rx.watch(stream, dead)
    assert wait_for(lambda: redis_client.exists(stream) and redis_client.xinfo_groups(stream))
    assert redis_client.xinfo_groups(stream)[0]["name"].decode() == GROUP
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


def test_a_flood_of_junk_is_dead_lettered_at_the_capped_rate_and_counted(redis_client):
    """Issue 56, N6: 50,000 junk entries on a head's reply stream became 37,628 dead-letter records and cycled the
    audit trail. Now a burst and then the rate per source stream are written; the rest are only counted."""
    stream, dead = f"t:{uuid.uuid4().hex}:reply:head.x.b", f"t:{uuid.uuid4().hex}:dead"
    sink, got = Collect(), []
    cap = DeadLetterCap(rate=5, burst=20)
    settings = Settings(redis={"block_ms": 100}, relay={"head_readers": 2})
    rx = Receiver(redis_client, settings, got.extend, sink, group=GROUP, dead_cap=cap)  # type: ignore[arg-type]
    rx.watch(stream, dead)
    assert wait_for(lambda: redis_client.exists(stream) and redis_client.xinfo_groups(stream))
    t0 = time.monotonic()
    for at in range(0, 5000, 500):
        pipe = redis_client.pipeline(transaction=False)
        for i in range(at, at + 500):
            pipe.xadd(stream, {"junk": str(i)})
        pipe.execute()
    assert wait_for(lambda: cap.written + cap.dropped >= 5000, timeout=30)
    spent = time.monotonic() - t0
    assert got == []
    assert 20 <= len(sink.dead) <= 20 + 5 * spent + 1
    assert cap.take_counts() == (len(sink.dead), 5000 - len(sink.dead))
    rx.unwatch(stream)
