"""Generations in flight split into groups whose rounds interleave (workers/head/groups.py, the batcher's
group-at-a-time batches): the plan's choice from measured times, and the groups of that size computed one at a
time, as the head's step loop hands them to `Batcher.compute`. Harness: tests/test_batcher.py."""
# ruff: noqa: F811  (the fixtures imported from the harness are redefined as test parameters, as pytest does)

from __future__ import annotations

import math

from tests.test_batcher import (  # noqa: F401  (tiny is a fixture)
    CTX,
    Head,
    Spec,
    Tiny,
    assert_same_round,
    spy,
    tiny,
)
from workers.head.groups import GroupPlan, bucket


def plan_with(compute: dict[int, float], wait: float) -> GroupPlan:
    plan = GroupPlan()
    for size, seconds in compute.items():
        plan.note_batch(size, seconds)
    plan.note_wait(wait)
    return plan


def test_groups_of_at_least_16_until_both_stages_are_measured() -> None:
    plan = GroupPlan()
    assert [plan.groups(n) for n in (1, 16, 31, 32, 64, 256)] == [1, 1, 1, 2, 4, 4]
    plan.note_batch(64, 0.07)
    assert plan.groups(64) == 4  # no round wait yet
    plan.note_batch(16, 0.05)
    plan.note_wait(0.001)  # a link far shorter than the compute: one group
    assert plan.groups(64) == 1
    assert [bucket(n) for n in (1, 2, 3, 64, 65)] == [1, 2, 4, 64, 128]


def test_groups_follow_the_ratio_of_link_to_compute() -> None:
    """A head whose batch compute is small against the round's wait splits into groups (each computes while the
    others' packets travel); one whose compute dominates, or whose small batches cost as much as large ones,
    stays whole."""
    # 256 in flight: 200 ms for 256, 110 for 128, 60 for 64; 130 ms on the wire: max(110 + 130, 2 * 110) = 240 < 330
    linky = plan_with({256: 0.200, 128: 0.110, 64: 0.060}, 0.130)
    assert linky.round_time(256, 1) == 0.200 + 0.130
    # G = 2: max(110 + 130, 2 * 110) = 240; G = 3 (86 rows, bucket 128): max(240, 330); G = 4: max(190, 240)
    assert linky.groups(256) == 2
    # compute-bound: the wire is short, a split only adds the per-batch costs
    assert plan_with({64: 0.100, 32: 0.080, 16: 0.070}, 0.010).groups(64) == 1
    # fixed costs: a batch of 16 costs what a batch of 64 does, so a split gains nothing
    assert plan_with({64: 0.050, 32: 0.050, 16: 0.050}, 0.100).groups(64) == 1
    assert plan_with({1: 0.02}, 0.09).groups(1) == 1  # one generation is one group


def test_an_unmeasured_bucket_is_scaled_from_the_nearest() -> None:
    plan = plan_with({64: 0.08}, 0.1)
    assert plan.estimate(64) == 0.08 and plan.estimate(32) == 0.04 and plan.estimate(128) == 0.16
    assert plan.estimate(16) is None  # a split is tried one halving at a time
    assert plan.groups(64) == 2  # the optimistic estimate tries the split, and then measures it
    plan.note_batch(32, 0.079)
    for _ in range(20):
        plan.note_batch(32, 0.079)
    assert plan.groups(64) == 1  # measured: a half batch costs what a whole one does, so the split does not pay


def test_the_batcher_computes_a_group_at_a_time(tiny: Tiny) -> None:
    """Four generations in flight and a plan of two groups: groups of live / G rounds (the step loop's size,
    `plan.groups(live)`), computed one after the other, run as two batches of two, in order; each round equals its
    round alone."""
    head, ref = Head(tiny, True), Head(tiny, True)
    head.batcher.plan = plan_with({4: 0.05, 2: 0.025, 1: 0.025}, 0.1)
    specs = [Spec(c, "model", 3) for c in CTX[:4]]
    works = [head.work(s) for s in specs]
    live = len(works)
    assert head.batcher.plan.groups(live) == 2
    size = math.ceil(live / head.batcher.plan.groups(live))
    calls = spy(head.engine, "forward_many")
    for at in range(0, live, size):
        head.batcher.compute(works[at : at + size])
    assert [c.caches for c in calls] == [[w.cache for w in works[:2]], [w.cache for w in works[2:]]]
    assert (head.batcher.batches, head.batcher.rounds) == (2, 4)
    for spec, w in zip(specs, works, strict=True):
        assert_same_round(w, ref.alone(spec), True)


def test_a_fixed_number_of_groups_is_kept() -> None:
    """`--groups N` (settings.relay.head_groups) fixes the split, never more groups than generations."""
    plan = GroupPlan(fixed=2)
    assert plan.groups(64) == 2 and plan.groups(1) == 1
    assert plan_with({64: 0.06, 32: 0.03}, 0.1).groups(64) == 4 and GroupPlan(fixed=1).groups(64) == 1
