"""Job progress (workers/head/job_function.py `Progress`): the token stream, checkpoints and cancel checks a running
job writes, off its round loop."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
from rq.serializers import JSONSerializer

from schemas.keys import Keys
from workers.head.job_function import JobCancelled, Progress


class Chars:
    """A tokenizer whose token i is one letter."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def test_token_stream_resend_is_not_streamed_twice(redis_client):
    """A progress flush sent again (redis-py resends a pipeline after a dropped connection) must not put
    the same text on the job's token stream twice: entry ids are where the text ends."""
    keys = Keys(prefix="resend")
    job = SimpleNamespace(id="j1", key="resend:job:j1", meta={}, serializer=JSONSerializer)
    progress = Progress(job, redis_client, keys, Chars(), 600, 0.2)  # type: ignore[arg-type]
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
    progress = Progress(job, redis_client, keys, Chars(), 600, 0.2)  # type: ignore[arg-type]
    gate = threading.Event()
    real_flush = progress.flush

    def held_flush(generated, final):
        gate.wait(30)  # a Redis far away: this flush is slow until the test lets it go
        real_flush(generated, final)

    monkeypatch.setattr(progress, "flush", held_flush)
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
