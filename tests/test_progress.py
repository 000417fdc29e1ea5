"""Job progress (workers/head/jobs/progress.py `Progress`): the token stream, checkpoints and cancel checks a running
job writes, off its round loop."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from rq.serializers import JSONSerializer

from schemas.keys import Keys
from workers.head.jobs.flushes import FlushPool
from workers.head.jobs.progress import JobCancelled, Progress


class Chars:
    """A tokenizer whose token i is one letter."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def test_token_stream_resend_is_not_streamed_twice(redis_client):
    """A progress flush sent again (redis-py resends a pipeline after a dropped connection) must not put
    the same text on the job's token stream twice: entry ids are where the text ends."""
    keys = Keys(prefix="resend")
    job = SimpleNamespace(id="j1", key="resend:job:j1", meta={}, serializer=JSONSerializer)
    progress = Progress(job, redis_client, keys, Chars(), 600, 0.2, FlushPool(redis_client, 1))  # type: ignore[arg-type]
    progress.flush([0, 1], final=False)
    progress.flushed_chars = 0  # as if the reply was lost and the same pipeline ran again
    progress.flush([0, 1], final=False)
    progress.flush([0, 1, 2], final=True)
    progress.flush([0, 1, 2], final=True)
    entries = redis_client.xrange(keys.tokens("j1"))
    assert "".join(f[b"text"].decode() for _, f in entries) == "abc"
    assert [f[b"final"] for _, f in entries] == [b"0", b"1"]


def test_progress_flushes_off_the_round_loop(redis_client, monkeypatch):
    """Rounds hand progress to a flusher thread: a slow Redis write does not hold the round that triggered
    it, flushes stay in order, and a cancel request found by a flush stops the generation a round later."""
    keys = Keys(prefix="offpath")
    job = SimpleNamespace(id="j2", key="offpath:job:j2", meta={}, serializer=JSONSerializer)
    progress = Progress(job, redis_client, keys, Chars(), 600, 0.2, FlushPool(redis_client, 1))  # type: ignore[arg-type]
    gate = threading.Event()
    real_took = progress.took_flush

    def held_took(replies, mark):
        gate.wait(30)  # a Redis far away: this flush is slow until the test lets it go
        return real_took(replies, mark)

    monkeypatch.setattr(progress, "took_flush", held_took)
    progress.on_tokens([0], [0])  # starts a flush, returns while it is held
    progress.on_tokens([1], [0, 1])  # the flush is still in flight: nothing queued behind it
    assert progress._inflight is not None and not progress._inflight.done()
    gate.set()
    progress._inflight.result(30)
    redis_client.set(keys.cancel("j2"), 1)
    progress.last_flush = 0.0
    progress.on_tokens([2], [0, 1, 2])  # takes the first flush's result, starts the next (finds the cancel)
    progress._inflight.exception(30)
    with pytest.raises(JobCancelled):
        progress.on_tokens([3], [0, 1, 2, 3])
    progress.wait()
    assert "".join(f[b"text"].decode() for _, f in redis_client.xrange(keys.tokens("j2"))) == "abc"
    assert redis_client.get(keys.checkpoint("j2")) is not None


def test_flushes_queued_together_share_one_round_trip(redis_client, monkeypatch):
    """The head's flush threads send every flush queued when they come free as one pipeline
    (workers/head/jobs/flushes.py): 40 jobs' flushes queued behind a slow one cost one more round trip, not 40; each
    job's answer stays its own (a cancel request fails that job's flush alone)."""
    import redis

    executes = []
    real_execute = redis.client.Pipeline.execute

    def counted(self, *a, **kw):
        if threading.current_thread().name.startswith("coalesce"):  # the pool's, not another test's head beacon
            executes.append(len(self.command_stack))
        return real_execute(self, *a, **kw)

    monkeypatch.setattr(redis.client.Pipeline, "execute", counted)
    keys = Keys(prefix="coalesce")
    pool = FlushPool(redis_client, threads=1, name="coalesce")
    jobs = [
        SimpleNamespace(id=f"j{i}", key=f"coalesce:job:j{i}", meta={}, serializer=JSONSerializer) for i in range(41)
    ]
    progs = [Progress(job, redis_client, keys, Chars(), 600, 0.2, pool) for job in jobs]  # type: ignore[arg-type]
    gate = threading.Event()
    real_took = progs[0].took_flush
    monkeypatch.setattr(progs[0], "took_flush", lambda replies, mark: gate.wait(30) and real_took(replies, mark))
    first = pool.submit(progs[0], [0], False)
    time.sleep(0.2)  # the pool's thread holds the first flush
    redis_client.set(keys.cancel("j7"), 1)
    rest = [pool.submit(p, [0, 1], False) for p in progs[1:]]
    gate.set()
    assert first.result(30) is True
    for i, fut in enumerate(rest, start=1):
        if i == 7:
            with pytest.raises(JobCancelled):
                fut.result(30)
        else:
            assert fut.result(30) is True
    assert len(executes) == 2, executes  # the slow one, then the 40 queued behind it together
    assert all(redis_client.get(keys.checkpoint(f"j{i}")) for i in range(41))
    pool.shutdown()
