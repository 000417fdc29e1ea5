"""The head's link meter (workers/head/link.py) and the draft length chosen for the link
(workers/speculative/adaptive.py): measured from publishes alone, checked against a model of the link."""

from __future__ import annotations

import random

import pytest

from workers.head.link import MIN_BUSY_BYTES, LinkMeter
from workers.speculative.adaptive import DraftLength, best_k

RTT, BW, ROW = 0.086, 25e6, 7168  # the notebooks link: 86 ms, 200 Mbit/s; a bf16 7B row


def _wire(meter: LinkMeter, publishes: list[tuple[float, int]], senders: int = 3) -> None:
    """Publishes through one shared wire of BW bytes/s and RTT, `senders` at a time: each (start, bytes) waits for
    the bytes queued before it, then its reply comes one round trip after its last byte left."""
    free = 0.0
    for t0, nbytes in publishes:
        start = max(t0, free)
        free = start + nbytes / BW
        meter.note_publish(t0, free + RTT, nbytes, nbytes // ROW)


def test_the_meter_finds_the_bandwidth_and_round_trip_of_a_shared_wire():
    """Three senders' publishes overlap on one wire: the union of the spans the wire was busy, not their sum,
    gives the bandwidth (within 10%); the shortest publish gives the round trip; bytes per row come through."""
    meter = LinkMeter(window_s=60)
    pubs = [(0.05 * i, 2_000_000 if i % 3 else 4_000) for i in range(60)]  # groups, and a small one now and then
    _wire(meter, pubs)
    est = meter.estimate()
    assert est.bandwidth == pytest.approx(BW, rel=0.1)
    assert est.rtt_s == pytest.approx(RTT, rel=0.1)
    assert est.row_bytes == pytest.approx(ROW, rel=0.05)


def test_an_unfilled_link_costs_a_draft_nothing():
    """Less than MIN_BUSY_BYTES in the window, or a link the head never fills: no wire cost (K as before)."""
    meter = LinkMeter()
    assert meter.draft_cost_ms() == 0.0
    meter.note_publish(0.0, RTT, MIN_BUSY_BYTES // 2, 10)
    assert meter.estimate().bandwidth is None and meter.draft_cost_ms() == 0.0


def test_a_drafts_wire_cost_grows_with_the_generations_in_flight():
    meter = LinkMeter(window_s=60)
    _wire(meter, [(0.05 * i, 2_000_000) for i in range(40)])
    meter.in_flight(1, 256)
    many = meter.draft_cost_ms()
    meter._cost = (0.0, "raw", float("-inf"))  # re-estimated at once (the cache holds 0.1 s)
    meter.in_flight(1, 16)
    assert many == pytest.approx(1000 * 256 * ROW / BW, rel=0.15)  # about 73 ms a draft row
    assert meter.draft_cost_ms() == pytest.approx(many / 16, rel=0.01)


def _model_k(alpha: float, sessions: int) -> int:
    """The K a model of the link gives: E(k) / (RTT + compute + sessions (k + 1) ROW / BW), compute 40 ms."""
    wire = 1000 * sessions * ROW / BW
    return best_k(alpha, 86 + 40 + wire, wire, 8)


@pytest.mark.parametrize("sessions", [1, 16, 64, 256])
def test_a_greedy_generation_takes_the_k_the_link_model_gives(sessions):
    """Rounds measured on a notebooks-like link (their wait holds the wire time of every session's k + 1 rows):
    the draft length settles on the link model's K, even with graphs (free compute); 256 sessions get 2 or 3,
    one session the most."""
    alpha, wire, rng = 0.78, 1000 * sessions * ROW / BW, random.Random(sessions)
    length = DraftLength(k_max=8)
    for _ in range(60):
        k = length.k
        accepted = next((i for i in range(k) if rng.random() > alpha), k)  # each draft kept with chance alpha
        wait = 86 + 40 + sessions * (k + 1) * ROW / BW * 1000
        length.update(k, accepted, 0.0, wait, timed=True, free=True, wire_ms=wire)
    want = _model_k(alpha, sessions)
    assert abs(length.k - want) <= 1, (length.k, want)
    if sessions == 256:
        assert length.k in (2, 3)
    if sessions == 1:
        assert length.k >= 6


def test_no_wire_cost_and_sampled_generations_keep_their_draft_length():
    """An unconstrained link (wire 0) keeps the graphs' K at its most, as before; a sampled generation (not timed)
    never weighs the link: its K depends on acceptance alone, so a seed gives the same text on any link."""
    free = DraftLength(k_max=8)
    sampled = DraftLength(k_max=8)
    ref = DraftLength(k_max=8)
    for i in range(12):
        acc = i % 4
        assert free.update(8, 8 if acc == 3 else acc, 0.0, 150.0, timed=True, free=True) == 8
        k1 = sampled.update(sampled.k, min(acc, sampled.k), 1.0, 150.0, timed=False, wire_ms=0.0)
        k2 = ref.update(ref.k, min(acc, ref.k), 1.0, 150.0, timed=False)
        assert k1 == k2
