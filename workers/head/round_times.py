"""Where one round's time went, added to its generation's `RoundTimings` (schemas/requests.py) from the head's
own clocks and the marks its tail put in the verdict (`Verdict.timings`). A tail's numbers are only as good as
its clock and its honesty: each is clamped to what the round's wait allows, never trusted to change anything
but these sums."""

from __future__ import annotations

import math
import time

from schemas.requests import RoundTimings

MAX_BATCH = 1 << 20  # a tail batch larger than this is not a plausible size: not counted


def add_round(
    t: RoundTimings,
    timings: dict[str, float],
    spans: tuple[float, float, float],
    sent_wall: float,
    hop_ms: list[float] | None = None,
) -> None:
    """Add one round: `spans` = (draft, head forward, wait from queueing the round to taking its verdict) in
    seconds; `sent_wall` = time.time() when the round was queued; `hop_ms`: each middle stage's time (the verdict's,
    summed per hop into `t.hop_ms`, a part of the relay's)."""
    draft_s, head_s, wait_s = spans
    wait_ms = wait_s * 1000

    def clamp(x: float) -> float:  # NaN and infinities (JSON lets a tail write them) count as nothing
        return min(max(x, 0.0), wait_ms) if math.isfinite(x) else 0.0

    tail_ms, verify_ms = clamp(timings.get("tail_forward_ms", 0.0)), clamp(timings.get("verify_ms", 0.0))
    t.draft_ms += draft_s * 1000
    t.head_forward_ms += head_s * 1000
    t.tail_forward_ms += tail_ms
    t.verify_ms += verify_ms
    batch = timings.get("batch", 0.0)
    t.tail_batch_rounds += int(batch) if 0 <= batch <= MAX_BATCH else 0
    queue_ms = clamp(timings.get("queue_ms", 0.0))  # the tail's, from entry ids
    t.tail_queue_ms += queue_ms
    t.relay_ms += max(wait_ms - tail_ms - verify_ms - queue_ms, 0.0)
    # the relay's parts, from wall-clock marks (meaningful where the clocks agree, as on one host)
    taken, replied = timings.get("taken_at_ms"), timings.get("replied_at_ms")
    if taken is not None:
        t.send_ms += clamp(taken - queue_ms - sent_wall * 1000)
    if replied is not None:
        t.back_ms += clamp(time.time() * 1000 - replied)
    t.tail_prepare_ms += clamp(timings.get("prepare_ms", 0.0))
    hops = list(hop_ms or ())
    t.hop_ms += [0.0] * (len(hops) - len(t.hop_ms))
    for i, ms in enumerate(hops):
        t.hop_ms[i] += clamp(ms)
