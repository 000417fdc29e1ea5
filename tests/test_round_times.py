"""A round's stage times (workers/head/round_times.py): the relay's parts come from the tail's wall-clock marks,
and whatever a tail writes in `Verdict.timings` is clamped to the round's own wait."""

from __future__ import annotations

import time

from schemas.requests import RoundTimings
from workers.head.round_times import add_round


def test_the_relay_splits_into_send_prepare_and_back() -> None:
    t, now = RoundTimings(), time.time() * 1000
    sent = (now - 100) / 1000  # queued 100 ms ago; in Redis 30 ms later; waited 5 ms; taken; replied 20 ms ago
    marks = {"queue_ms": 5.0, "taken_at_ms": now - 65, "replied_at_ms": now - 20, "prepare_ms": 3.0}
    add_round(t, marks | {"tail_forward_ms": 10.0, "verify_ms": 2.0, "batch": 4}, (0.01, 0.005, 0.1), sent)
    assert abs(t.send_ms - 30) < 2 and abs(t.back_ms - 20) < 2 and t.tail_prepare_ms == 3.0
    assert t.tail_queue_ms == 5.0 and abs(t.relay_ms - (100 - 10 - 2 - 5)) < 1e-6
    assert t.draft_ms == 10.0 and t.head_forward_ms == 5.0 and t.tail_batch_rounds == 4


def test_a_tail_that_lies_moves_nothing_past_the_round_wait() -> None:
    t = RoundTimings()
    lies = {"queue_ms": 1e12, "taken_at_ms": -1e15, "replied_at_ms": 1e18, "prepare_ms": 1e9}
    add_round(t, lies | {"tail_forward_ms": -5.0, "verify_ms": 1e9, "batch": 1e30}, (0.0, 0.0, 0.05), time.time())
    for v in (t.send_ms, t.back_ms, t.tail_prepare_ms, t.tail_queue_ms, t.verify_ms, t.tail_forward_ms):
        assert 0.0 <= v <= 50.0
    assert t.tail_batch_rounds == 0 and t.relay_ms == 0.0


def test_a_tail_that_writes_nan_or_infinity_moves_nothing() -> None:
    t = RoundTimings()
    bad = float("nan")
    marks = {"queue_ms": bad, "taken_at_ms": float("inf"), "replied_at_ms": bad, "prepare_ms": float("-inf")}
    add_round(t, marks | {"tail_forward_ms": bad, "verify_ms": float("inf"), "batch": bad}, (0.0, 0.0, 0.05), 0.0)
    assert RoundTimings.model_validate_json(t.model_dump_json()) == t  # stored and read back as it was
    assert t.send_ms == t.back_ms == t.tail_prepare_ms == t.tail_queue_ms == t.verify_ms == 0.0
    assert t.relay_ms == 50.0
