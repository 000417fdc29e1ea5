"""The tail's intake (workers/tail/intake.py): it reads and checks rounds on a thread beside the loop; what it read
while the loop was busy comes to the loop as one batch, every entry with its own check, and it holds no more than a
batch's worth ahead."""

from __future__ import annotations

import secrets
import threading
import time

from relay_broker.streams import GroupReader
from schemas.settings import Settings
from workers.tail.intake import Intake, Taken


class _Checks:
    """Stands in for the Authenticator: each entry's check is its fields."""

    def __init__(self) -> None:
        self.batches: list[int] = []

    def check(self, entries: list[dict]) -> list:
        self.batches.append(len(entries))
        return list(entries)


def _intake(redis_client, slots: int) -> tuple[Intake, str, threading.Event, _Checks]:
    stream = f"intake-{secrets.token_hex(4)}"
    settings = Settings(redis={"block_ms": 50})
    reader = GroupReader(redis_client, "tails", "t1", [stream], settings=settings)
    stop, checks = threading.Event(), _Checks()
    intake = Intake(
        reader,
        checks,  # type: ignore[arg-type]
        slots=slots,
        open_sessions=lambda: 0,
        linger_ms=0,
        max_packet_bytes=1 << 20,
        settings=settings,
        stop=stop,
    )
    return intake, stream, stop, checks


def _take_all(intake: Intake, n: int) -> list[Taken]:
    got: list[Taken] = []
    deadline = time.monotonic() + 10
    while sum(len(t.flat) for t in got) < n and time.monotonic() < deadline:
        if (t := intake.take(0.1)) is not None:
            got.append(t)
    return got


def test_rounds_read_while_the_loop_is_busy_come_as_one_batch(redis_client) -> None:
    intake, stream, stop, checks = _intake(redis_client, slots=16)
    try:
        intake.start()
        for i in range(3):  # three reads' worth, none taken yet: the loop is "computing"
            redis_client.xadd(stream, {b"h": b"%d" % i})
            time.sleep(0.2)
        (taken,) = _take_all(intake, 3)
        assert [f[b"h"] for _, _, f in taken.flat] == [b"0", b"1", b"2"]
        assert taken.checked == [f for _, _, f in taken.flat] and taken.entries == 3 and len(checks.batches) == 3
        assert taken.taken_at_ms > 0 and taken.queue_ms >= 0
        assert intake.take(0.05) is None  # nothing more
    finally:
        stop.set()


def test_the_intake_holds_at_most_a_batch_ahead(redis_client) -> None:
    intake, stream, stop, _ = _intake(redis_client, slots=2)
    try:
        intake.start()
        for i in range(6):
            redis_client.xadd(stream, {b"h": b"%d" % i})
        time.sleep(0.5)
        first = intake.take(1)
        assert first is not None and 2 <= len(first.flat) <= 3  # a batch's worth (and one read past it at most)
        rest = _take_all(intake, 6 - len(first.flat))
        assert [f[b"h"] for t in (first, *rest) for _, _, f in t.flat] == [b"%d" % i for i in range(6)]
    finally:
        stop.set()
