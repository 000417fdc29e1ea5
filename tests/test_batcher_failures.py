"""The head's batcher when things go wrong, without subprocesses: a bad input or a broken drafter fails only
its own round, interrupts fail the whole batch, work queued during a batch runs in the next one, and a round
interrupted while waiting is withdrawn. Harness: tests/test_batcher.py."""
# ruff: noqa: F811  (the fixtures imported from the harness are redefined as test parameters, as pytest does)

from __future__ import annotations

import time

import pytest

from tests.test_batcher import (  # noqa: F401  (tiny and _no_stray_threads are fixtures)
    CTX,
    SAMPLED,
    STATIC,
    BrokenDrafter,
    Head,
    Spec,
    Submitter,
    Tiny,
    _no_stray_threads,
    assert_same_round,
    join,
    queued,
    run_together,
    spy,
    submit,
    tiny,
    wait_until,
)


@STATIC
def test_a_bad_input_fails_only_its_own_round(tiny: Tiny, static: bool) -> None:
    """A round whose uncached token is outside the vocabulary fails the batch's forward; every round of that batch
    is then retried alone from where it started (caches a dynamic forward already advanced are cropped back), so
    the others complete exactly as alone and only the bad one's thread gets the exception."""
    head, ref = Head(tiny, static), Head(tiny, static)
    specs = [Spec(CTX[0], "model", 3), Spec(CTX[1], "ngram", 3, bad=True), Spec(CTX[2], "model", 2)]
    works = [head.work(s) for s in specs]
    calls = spy(head.engine, "forward_many")
    subs = run_together(head.batcher, works, calls)
    assert isinstance(subs[1].error, IndexError) and works[1].error is subs[1].error
    assert subs[1].result is None and works[1].hidden is None
    assert works[1].cache.length == works[1].start and works[1].finished
    assert [len(c.caches) for c in calls] == [3, 1, 1, 1]  # the failed batch, then each round alone, in order
    assert [c.caches[0] for c in calls[1:]] == [w.cache for w in works]
    assert len({c.thread for c in calls}) == 1  # the thread that took the batch retried it
    assert (head.batcher.batches, head.batcher.rounds) == (2, 2)  # counters count completed batches only
    for i in (0, 2):
        assert subs[i].error is None
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
    subs = run_together(head.batcher, works, calls)
    assert isinstance(subs[1].error, RuntimeError) and "drafter broke" in str(subs[1].error)
    assert [len(c.caches) for c in calls] == [1, 1]
    assert [c.caches[0] for c in calls] == [works[0].cache, works[2].cache]
    for i in (0, 2):
        assert_same_round(works[i], ref.alone(specs[i]), static)


def test_a_lone_failing_round_raises_without_retry(tiny: Tiny) -> None:
    head = Head(tiny, True)
    work = head.work(Spec(CTX[0], "ngram", 2, bad=True))
    calls = spy(head.engine, "forward_many")
    with pytest.raises(IndexError):
        head.batcher.run(work)
    assert len(calls) == 1 and work.finished and (head.batcher.batches, head.batcher.rounds) == (0, 0)


def test_retry_after_a_neighbours_failure_keeps_sampled_drafts(tiny: Tiny) -> None:
    """A sampled round batched with a bad one should draft what it drafts alone (same seed): its retry should not
    depend on the failed attempt."""
    head, ref = Head(tiny, False), Head(tiny, False)
    specs = [Spec(CTX[0], "sampled", 3, seed=11), Spec(CTX[1], "ngram", 2, bad=True)]
    works = [head.work(s) for s in specs]
    run_together(head.batcher, works)
    assert works[0].error is None and works[0].draft is not None
    want = ref.alone(specs[0]).draft
    assert want is not None and works[0].draft.tokens == want.tokens


class Shutdown(BaseException):
    """An interrupt (a job timeout, a shutdown) raised inside a batch."""


@STATIC
def test_an_interrupt_fails_the_whole_batch_without_retry(tiny: Tiny, static: bool) -> None:
    """A BaseException inside a batch is not isolated: every round of the batch fails with it, no round is
    retried, the computing thread raises it on, and every waiting thread is released."""
    head = Head(tiny, static)
    works = [head.work(Spec(c, "model", 2)) for c in CTX[:3]]
    stop = Shutdown("stop")

    def interrupt(n: int) -> None:
        raise stop

    calls = spy(head.engine, "forward_many", interrupt)
    subs = run_together(head.batcher, works, calls)
    assert len(calls) == 1
    assert all(s.error is stop and s.work.error is stop and s.work.finished for s in subs)
    assert head.batcher._queue == [] and (head.batcher.batches, head.batcher.rounds) == (0, 0)


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
    subs = run_together(head.batcher, works, calls)
    assert len(calls) == 2
    assert all(s.error is stop and s.work.error is stop and s.work.finished for s in subs)


# --- the lock, who computes, and order ----------------------------------------------------------------------------


def test_work_queued_during_a_batch_runs_in_the_next_one(tiny: Tiny) -> None:
    """A batch takes what is queued when its thread gets the lock; a round submitted while it computes waits for
    the lock and runs in a later batch (here computed by its own thread), exactly as alone."""
    head, ref = Head(tiny, True), Head(tiny, True)
    specs = [Spec(CTX[0], "model", 2), Spec(CTX[1], "model", 3), Spec(CTX[2], "ngram", 3)]
    works = [head.work(s) for s in specs]
    late: list[Submitter] = []

    def during_first_batch(n: int) -> None:
        if n == 1:
            late.append(submit(head.batcher, works[2]))
            assert not works[2].finished

    calls = spy(head.engine, "forward_many", during_first_batch)
    subs = run_together(head.batcher, works[:2], calls)
    join(late)
    assert [len(c.caches) for c in calls] == [2, 1]
    assert calls[0].thread in subs and calls[1].thread is late[0]
    assert (head.batcher.batches, head.batcher.rounds) == (2, 3)
    for spec, w in zip(specs, works, strict=True):
        assert_same_round(w, ref.alone(spec), True)


def test_a_thread_holding_the_lock_keeps_rounds_from_computing(tiny: Tiny) -> None:
    """The lock is the runtime's: while anyone holds it no round computes; once let go, the queued round runs."""
    head = Head(tiny, False)
    work = head.work(Spec(CTX[0], "ngram", 2))
    calls = spy(head.engine, "forward_many")
    with head.batcher.lock:
        sub = submit(head.batcher, work)
        time.sleep(0.05)
        assert not work.finished and calls == [] and sub.is_alive()
    join([sub])
    assert sub.error is None and work.hidden is not None and len(calls) == 1


class InterruptingLock:
    """A lock whose acquisition is interrupted (as a job timeout interrupts a thread waiting for the lock)."""

    def __enter__(self) -> None:
        raise Shutdown("interrupted while waiting")

    def __exit__(self, *exc: object) -> None:
        return None


def test_a_round_interrupted_while_waiting_is_withdrawn(tiny: Tiny) -> None:
    """A thread interrupted before it gets the lock takes its round back out of the queue and raises at once:
    no later batch computes it (its caches are the caller's again), and it does not wait for one."""
    head = Head(tiny, False)
    withdrawn, later = head.work(Spec(CTX[0], "ngram", 2)), head.work(Spec(CTX[1], "ngram", 2))
    real_lock, head.batcher.lock = head.batcher.lock, InterruptingLock()  # type: ignore[assignment]
    sub = Submitter(head.batcher, withdrawn)
    sub.start()
    sub.join(2.0)
    assert not sub.is_alive(), "the interrupted caller waits for a round no batch will compute"
    assert isinstance(sub.error, Shutdown)
    assert head.batcher._queue == [] and not withdrawn.finished and withdrawn.hidden is None
    head.batcher.lock = real_lock
    calls = spy(head.engine, "forward_many")
    head.batcher.run(later)
    assert len(calls) == 1 and calls[0].caches == [later.cache]
    assert withdrawn.cache.length == withdrawn.start  # untouched
