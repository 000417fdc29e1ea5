"""The head's batcher when things go wrong, without subprocesses: a bad input or a broken drafter fails only
its own round of the group handed to `Batcher.compute`, and an interrupt fails the whole group. Harness:
tests/test_batcher.py."""
# ruff: noqa: F811  (the fixtures imported from the harness are redefined as test parameters, as pytest does)

from __future__ import annotations

import pytest

from tests.test_batcher import (  # noqa: F401  (tiny is a fixture)
    CTX,
    STATIC,
    BrokenDrafter,
    Head,
    Spec,
    Tiny,
    assert_same_round,
    spy,
    tiny,
)


@STATIC
def test_a_bad_input_fails_only_its_own_round(tiny: Tiny, static: bool) -> None:
    """A round whose uncached token is outside the vocabulary fails the batch's forward; every round of that batch
    is then retried alone from where it started (caches a dynamic forward already advanced are cropped back), so
    the others complete exactly as alone and only the bad one gets the exception (`compute` raises none)."""
    head, ref = Head(tiny, static), Head(tiny, static)
    specs = [Spec(CTX[0], "model", 3), Spec(CTX[1], "ngram", 3, bad=True), Spec(CTX[2], "model", 2)]
    works = [head.work(s) for s in specs]
    calls = spy(head.engine, "forward_many")
    head.batcher.compute(works)
    assert isinstance(works[1].error, IndexError) and works[1].hidden is None
    assert works[1].cache.length == works[1].start
    assert [len(c.caches) for c in calls] == [3, 1, 1, 1]  # the failed batch, then each round alone, in order
    assert [c.caches[0] for c in calls[1:]] == [w.cache for w in works]
    assert (head.batcher.batches, head.batcher.rounds) == (2, 2)  # counters count completed batches only
    for i in (0, 2):
        assert works[i].error is None
        assert_same_round(works[i], ref.alone(specs[i]), static)
    with pytest.raises(IndexError):  # alone, the bad round fails the same way
        ref.alone(specs[1])


@STATIC
def test_a_failing_drafter_fails_only_its_own_round(tiny: Tiny, static: bool) -> None:
    """A drafter that raises fails the batch before any forward; the rounds are retried alone, the broken one
    fails again in drafting (no forward), the others complete exactly as alone."""
    head, ref = Head(tiny, static), Head(tiny, static)
    specs = [Spec(CTX[0], "model", 3), Spec(CTX[1], "broken", 3), Spec(CTX[2], "ngram", 2)]
    works = [head.work(s) for s in specs]
    calls = spy(head.engine, "forward_many")
    head.batcher.compute(works)
    assert isinstance(works[1].error, RuntimeError) and "drafter broke" in str(works[1].error)
    assert [len(c.caches) for c in calls] == [1, 1]
    assert [c.caches[0] for c in calls] == [works[0].cache, works[2].cache]
    for i in (0, 2):
        assert_same_round(works[i], ref.alone(specs[i]), static)


def test_a_lone_failing_round_fails_without_retry(tiny: Tiny) -> None:
    """A group of one whose forward fails is not retried: the round gets the error (`compute` raises none)."""
    head = Head(tiny, True)
    work = head.work(Spec(CTX[0], "ngram", 2, bad=True))
    calls = spy(head.engine, "forward_many")
    head.batcher.compute([work])
    assert isinstance(work.error, IndexError) and work.hidden is None
    assert len(calls) == 1 and (head.batcher.batches, head.batcher.rounds) == (0, 0)


def test_retry_after_a_neighbours_failure_keeps_sampled_drafts(tiny: Tiny) -> None:
    """A sampled round batched with a bad one should draft what it drafts alone (same seed): its retry should not
    depend on the failed attempt."""
    head, ref = Head(tiny, False), Head(tiny, False)
    specs = [Spec(CTX[0], "sampled", 3, seed=11), Spec(CTX[1], "ngram", 2, bad=True)]
    works = [head.work(s) for s in specs]
    head.batcher.compute(works)
    assert works[0].error is None and works[0].draft is not None
    want = ref.alone(specs[0]).draft
    assert want is not None and works[0].draft.tokens == want.tokens


class Shutdown(BaseException):
    """An interrupt (a job timeout, a shutdown) raised inside a batch."""


@STATIC
def test_an_interrupt_fails_the_whole_batch_without_retry(tiny: Tiny, static: bool) -> None:
    """A BaseException inside a batch is not isolated: every round of the batch fails with it, no round is
    retried, and `compute` raises it on (to the step loop, which fails every generation in flight)."""
    head = Head(tiny, static)
    works = [head.work(Spec(c, "model", 2)) for c in CTX[:3]]
    stop = Shutdown("stop")

    def interrupt(n: int) -> None:
        raise stop

    calls = spy(head.engine, "forward_many", interrupt)
    with pytest.raises(Shutdown) as raised:
        head.batcher.compute(works)
    assert raised.value is stop and len(calls) == 1
    assert all(w.error is stop for w in works)
    assert (head.batcher.batches, head.batcher.rounds) == (0, 0)


def test_an_interrupt_during_the_retries_fails_every_round_left(tiny: Tiny) -> None:
    """A batch fails, and while its rounds are retried alone an interrupt comes: no further round is retried and
    every round of the batch fails with the interrupt; none is finished with neither hidden states nor an error
    (its round loop would trip over a round without hidden states)."""
    head = Head(tiny, False)
    works = [head.work(Spec(c, "ngram", 2)) for c in CTX[:3]]
    stop = Shutdown("stop")

    def fail_then_interrupt(n: int) -> None:
        if n == 1:
            raise RuntimeError("the batch fails")
        if n == 2:
            raise stop  # during the first round's retry

    calls = spy(head.engine, "forward_many", fail_then_interrupt)
    with pytest.raises(Shutdown) as raised:
        head.batcher.compute(works)
    assert raised.value is stop and len(calls) == 2
    assert all(w.error is stop for w in works)
