"""Client.wait and Client.follow against the session's real Redis, with no worker: each test plays the head's
part by hand (job status through RQ's Job API, token-stream entries, the stored result)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis
from click.testing import CliRunner

from producer.cli import main
from producer.cli_jobs import show_wait
from producer.client import Client, Followed, JobEnded, TextChunk, WaitTimeout
from relay_broker.connection import connect
from schemas.errors import ShardFlowError, TransportError
from schemas.requests import GenerationRequest, GenerationResult, RoundTimings
from schemas.settings import DEFAULTS


@pytest.fixture
def client(redis_server) -> Iterator[Client]:
    """A client on its own connection (tests patch it), under a prefix and queue of its own."""
    name = uuid.uuid4().hex[:8]
    r = connect(redis_server.url)
    yield Client(r, prefix=f"p-client-{name}", queue=f"q-client-{name}")
    r.close()


def enqueue(client: Client, n: int) -> list[str]:
    return client.enqueue([GenerationRequest(prompt=f"prompt {i}") for i in range(n)]).job_ids


def set_status(client: Client, job_id: str, status: str, error: str | None = None) -> None:
    """What RQ and the head's job function leave on a job record: its status, and an error in its meta."""
    (job,) = client.jobs([job_id])
    assert not isinstance(job, str | None)
    if error is not None:
        job.meta["error"] = error
        job.save_meta()
    job.set_status(status)  # type: ignore[arg-type]


def finish(client: Client, job_id: str, text: str) -> None:
    """Store a result as the head does (it validates as a GenerationResult), then mark the job finished."""
    result = GenerationResult(
        session_id=job_id,
        text=text,
        token_ids=[1, 2],
        finish_reason="length",
        prompt_tokens=3,
        completion_tokens=2,
        rounds=1,
        drafted_tokens=0,
        accepted_tokens=0,
        mean_accepted=0.0,
        tokens_per_round=2.0,
        tokens_per_s=10.0,
        timings=RoundTimings(),
    )
    client.r.set(client.keys.result(job_id), result.model_dump_json())
    set_status(client, job_id, "finished")


def text(client: Client, job_id: str, entry_id: str, chunk: str, last: bool = False) -> None:
    client.r.xadd(client.keys.tokens(job_id), {b"text": chunk.encode(), b"final": b"1" if last else b"0"}, id=entry_id)


def flaky(monkeypatch: pytest.MonkeyPatch, r: redis.Redis, name: str, times: int = 1) -> list[int]:
    """Make `r.<name>` raise redis.ConnectionError its first `times` calls; returns the count of calls."""
    real, calls = getattr(r, name), [0]

    def call(*args, **kwargs):
        calls[0] += 1
        if calls[0] <= times:
            raise redis.ConnectionError("connection lost (test)")
        return real(*args, **kwargs)

    monkeypatch.setattr(r, name, call)
    return calls


# --- wait -------------------------------------------------------------------------------------------------
def test_wait_returns_once_every_job_is_final(client):
    first, second = enqueue(client, 2)
    finish(client, first, "done")
    seen: list[list[str]] = []

    def progress(views):
        seen.append([v.status for v in views])
        if len(seen) == 1:
            set_status(client, second, "failed", error="boom")

    views = client.wait([first, second], timeout=30, on_progress=progress)
    assert seen == [["finished", "queued"], ["finished", "failed"]]
    assert views[0].result is not None and views[0].result["text"] == "done"
    assert (views[1].status, views[1].error, views[1].index) == ("failed", "boom", 1)


def test_wait_times_out_with_a_typed_error(client):
    (job,) = enqueue(client, 1)
    set_status(client, job, "started")
    with pytest.raises(WaitTimeout) as got:
        client.wait([job], timeout=0.4)
    assert isinstance(got.value, ShardFlowError)
    assert str(got.value) == "timed out after 0s (1 started)"
    assert [v.status for v in got.value.views] == ["started"]


def test_wait_rides_out_a_lost_redis(client, monkeypatch):
    (job,) = enqueue(client, 1)
    finish(client, job, "done")
    calls = flaky(monkeypatch, client.r, "mget")
    retries: list[tuple[BaseException, float]] = []
    client.on_retry = lambda e, s: retries.append((e, s))
    assert [v.status for v in client.wait([job], timeout=30)] == ["finished"]
    assert calls[0] == 2 and len(retries) == 1
    assert isinstance(retries[0][0], redis.ConnectionError) and retries[0][1] == DEFAULTS.reconnect_min_s


def test_wait_gives_up_on_redis_past_its_deadline(client, monkeypatch):
    (job,) = enqueue(client, 1)
    flaky(monkeypatch, client.r, "mget", times=100)
    with pytest.raises(TransportError, match=r"^Redis unreachable: connection lost \(test\)$"):
        client.wait([job], timeout=0.2)


# --- follow -----------------------------------------------------------------------------------------------
def test_follow_yields_text_in_order_and_skips_junk(client):
    first, second = enqueue(client, 2)
    tokens = client.keys.tokens(first)
    client.r.xadd(tokens, {b"junk": b"\xff\xfe"}, id="1-0")  # others can write token streams
    text(client, first, "5-0", "Hel")
    client.r.xadd(tokens, {b"text": b"x", b"final": b"2"}, id="6-0")
    client.r.xadd(tokens, {b"text": b"x", b"final": b"0", b"extra": b"1"}, id="7-0")
    text(client, first, "8-0", "lo", last=True)
    text(client, second, "5-0", "Wor")
    finish(client, first, "Hello")
    set_status(client, second, "failed", error="boom")

    events = list(client.follow([first, second], timeout=30))
    assert events[:3] == [
        TextChunk(first, 0, "Hel", False),
        TextChunk(first, 0, "lo", True),
        TextChunk(second, 1, "Wor", False),
    ]
    assert isinstance(events[3], JobEnded) and events[3].view.job_id == second
    assert (events[3].view.status, events[3].view.error) == ("failed", "boom")
    assert isinstance(events[4], Followed) and len(events) == 5
    assert [v.status for v in events[4].views] == ["finished", "failed"]
    assert events[4].views[0].result["text"] == "Hello"


def test_follow_streams_text_as_it_commits(client):
    (job,) = enqueue(client, 1)
    set_status(client, job, "started")
    text(client, job, "5-0", "a")
    followed = client.follow([job], timeout=30)
    assert next(followed) == TextChunk(job, 0, "a", False)
    text(client, job, "6-0", "b")
    text(client, job, "7-0", "c", last=True)
    finish(client, job, "abc")
    events = list(followed)
    assert events[:2] == [TextChunk(job, 0, "b", False), TextChunk(job, 0, "c", True)]
    assert isinstance(events[2], Followed) and len(events) == 3


def test_follow_ends_a_finished_job_whose_end_marker_is_missing(client):
    (job,) = enqueue(client, 1)
    text(client, job, "5-0", "abc")  # the head's end marker lost (or expired)
    finish(client, job, "abc")
    events = list(client.follow([job], timeout=30))
    assert events[0] == TextChunk(job, 0, "abc", False)
    assert isinstance(events[1], JobEnded) and events[1].view.status == "finished"
    assert isinstance(events[2], Followed) and len(events) == 3


def test_follow_times_out_with_a_typed_error(client):
    (job,) = enqueue(client, 1)
    text(client, job, "5-0", "abc")
    followed = client.follow([job], timeout=0.5)
    assert next(followed) == TextChunk(job, 0, "abc", False)
    with pytest.raises(WaitTimeout, match=r"^timed out after 0s \(1 queued\)$"):
        next(followed)


def test_follow_rides_out_a_lost_redis(client, monkeypatch):
    (job,) = enqueue(client, 1)
    text(client, job, "5-0", "abc", last=True)
    finish(client, job, "abc")
    calls = flaky(monkeypatch, client.r, "xread")
    retries: list[float] = []
    client.on_retry = lambda e, s: retries.append(s)
    events = list(client.follow([job], timeout=30))
    assert events[0] == TextChunk(job, 0, "abc", True) and isinstance(events[1], Followed)
    assert calls[0] == 2 and retries == [DEFAULTS.reconnect_min_s]


# --- the CLI on top: it prints what the client yields, exit codes and messages unchanged -------------------
def cli(client: Client, redis_server, *args: str):
    opts = ["--queue", client.queue_name, "--prefix", client.keys.prefix, "--redis-url", redis_server.url]
    return CliRunner().invoke(main, [*args, *opts])


def test_cli_follow_prints_text_and_failures(client, redis_server):
    first, second = enqueue(client, 2)
    text(client, first, "5-0", "Hel")
    text(client, first, "6-0", "lo", last=True)
    finish(client, first, "Hello")
    set_status(client, second, "failed", error="boom")
    res = cli(client, redis_server, "results", first.rsplit("-", 1)[0], "--follow", "--timeout", "30")
    assert res.exit_code == 1 and res.stdout == "[0] Hello\n[1] failed: boom\n"


def test_cli_wait_timeout_is_exit_5(client, redis_server):
    (job,) = enqueue(client, 1)
    res = cli(client, redis_server, "results", job, "--wait", "--timeout", "1")
    assert res.exit_code == 5 and "error: timed out after 1s (1 queued)" in res.stderr


def test_cli_says_redis_is_unreachable_while_riding_it_out(client, monkeypatch, capsys):
    (job,) = enqueue(client, 1)
    finish(client, job, "done")
    flaky(monkeypatch, client.r, "mget")
    assert [v.status for v in show_wait(client, [job], timeout=30)] == ["finished"]
    err = capsys.readouterr().err
    assert "Redis unreachable (connection lost (test)); retrying in 0.5s" in err
    assert "progress: 1/1 done (1 finished)" in err
