"""Client.wait and Client.follow against the session's real Redis, with no worker: each test plays the head's
part by hand (job status through RQ's Job API, token-stream entries, the stored result)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis
from click.testing import CliRunner

from producer.cli import main
from producer.cli_watch import show_wait
from producer.client import Client, Followed, JobEnded, StreamBroken, TextChunk, WaitTimeout
from relay_broker.connection import connect
from schemas.errors import ShardFlowError, TransportError
from schemas.requests import GenerationRequest, GenerationResult, RoundTimings
from schemas.settings import Settings


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


def finish(client: Client, job_id: str, text: str, stream_broken: str | None = None) -> None:
    """Store a result as the head does (it validates as a GenerationResult), then mark the job finished."""
    result = GenerationResult(
        stream_broken=stream_broken,
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
    calls = flaky(monkeypatch, client.r, "pipeline")
    retries: list[tuple[BaseException, float]] = []
    client.on_retry = lambda e, s: retries.append((e, s))
    assert [v.status for v in client.wait([job], timeout=30)] == ["finished"]
    assert calls[0] == 2 and len(retries) == 1
    assert isinstance(retries[0][0], redis.ConnectionError) and retries[0][1] == Settings().redis.reconnect_min_s


def test_wait_gives_up_on_redis_past_its_deadline(client, monkeypatch):
    (job,) = enqueue(client, 1)
    flaky(monkeypatch, client.r, "pipeline", times=100)
    with pytest.raises(TransportError, match=r"^Redis unreachable: connection lost \(test\)$"):
        client.wait([job], timeout=0.2)


# --- follow -----------------------------------------------------------------------------------------------
def test_follow_yields_text_in_order_and_skips_junk(client):
    first, second = enqueue(client, 2)
    tokens = client.keys.tokens(first)
    client.r.xadd(tokens, {b"junk": b"\xff\xfe"}, id="1-0")  # others can write token streams
    text(client, first, "3-0", "Hel")  # the head's ids: where its text ends (then 1 for its end marker)
    client.r.xadd(tokens, {b"text": b"x", b"final": b"2"}, id="3-1")
    client.r.xadd(tokens, {b"text": b"x", b"final": b"0", b"extra": b"1"}, id="4-0")
    text(client, first, "5-1", "lo", last=True)
    text(client, second, "3-0", "Wor")
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
    text(client, job, "1-0", "a")
    followed = client.follow([job], timeout=30)
    assert next(followed) == TextChunk(job, 0, "a", False)
    text(client, job, "2-0", "b")
    text(client, job, "3-1", "c", last=True)
    finish(client, job, "abc")
    events = list(followed)
    assert events[:2] == [TextChunk(job, 0, "b", False), TextChunk(job, 0, "c", True)]
    assert isinstance(events[2], Followed) and len(events) == 3


def test_follow_ends_a_finished_job_whose_end_marker_is_missing(client):
    (job,) = enqueue(client, 1)
    text(client, job, "3-0", "abc")  # the head's end marker lost (or expired)
    finish(client, job, "abc")
    events = list(client.follow([job], timeout=30))
    assert events[0] == TextChunk(job, 0, "abc", False)
    assert isinstance(events[1], JobEnded) and events[1].view.status == "finished"
    assert isinstance(events[2], Followed) and len(events) == 3


def test_follow_times_out_with_a_typed_error(client):
    (job,) = enqueue(client, 1)
    text(client, job, "3-0", "abc")
    followed = client.follow([job], timeout=0.5)
    assert next(followed) == TextChunk(job, 0, "abc", False)
    with pytest.raises(WaitTimeout, match=r"^timed out after 0s \(1 queued\)$"):
        next(followed)


def test_follow_rides_out_a_lost_redis(client, monkeypatch):
    (job,) = enqueue(client, 1)
    text(client, job, "3-1", "abc", last=True)
    finish(client, job, "abc")
    calls = flaky(monkeypatch, client.r, "xread")
    retries: list[float] = []
    client.on_retry = lambda e, s: retries.append(s)
    events = list(client.follow([job], timeout=30))
    assert events[0] == TextChunk(job, 0, "abc", True) and isinstance(events[1], Followed)
    assert calls[0] == 2 and retries == [Settings().redis.reconnect_min_s]


# --- the CLI on top: it prints what the client yields, exit codes and messages unchanged -------------------
def cli(client: Client, redis_server, *args: str):
    opts = ["--queue", client.queue_name, "--prefix", client.keys.prefix, "--redis-url", redis_server.url]
    return CliRunner().invoke(main, [*args, *opts])


def test_cli_follow_prints_text_and_failures(client, redis_server):
    first, second = enqueue(client, 2)
    text(client, first, "3-0", "Hel")
    text(client, first, "5-1", "lo", last=True)
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
    flaky(monkeypatch, client.r, "pipeline")
    assert [v.status for v in show_wait(client, [job], timeout=30)] == ["finished"]
    err = capsys.readouterr().err
    assert "Redis unreachable (connection lost (test)); retrying in 0.5s" in err
    assert "progress: 1/1 done (1 finished)" in err


# --- token streams that others broke (issue 24, case 5): never a silently truncated text ---------------------
def test_follow_completes_a_stream_an_automatic_id_broke_from_the_result(client):
    """A junk entry with an automatic id (here even a well-formed end marker) makes Redis refuse the head's
    later entries: the follower skips it (not where the head's text ends) and completes the text from the
    stored result, saying why (the head's reason)."""
    (job,) = enqueue(client, 1)
    set_status(client, job, "started")
    text(client, job, "3-0", "Hel")
    client.r.xadd(client.keys.tokens(job), {b"text": b"evil", b"final": b"1"})  # id: Redis's clock, far ahead
    finish(client, job, "Hello world", stream_broken="the token stream broke: another client added an entry")
    events = list(client.follow([job], timeout=30))
    assert events[0] == TextChunk(job, 0, "Hel", False)
    assert isinstance(events[1], StreamBroken) and events[1].repaired
    assert events[1].reason == "the token stream broke: another client added an entry"
    assert events[2] == TextChunk(job, 0, "lo world", True)
    assert isinstance(events[3], Followed) and len(events) == 4


def test_follow_reads_past_a_stream_key_of_another_type(client):
    """A SET on one job's token stream fails every XREAD that names it: that job is read no more (its text
    comes from its result, said so), the others are followed as usual."""
    first, second = enqueue(client, 2)
    client.r.set(client.keys.tokens(first), "junk")
    text(client, second, "3-1", "abc", last=True)
    finish(client, first, "Hello")
    finish(client, second, "abc")
    events = list(client.follow([first, second], timeout=30))
    assert TextChunk(second, 1, "abc", True) in events and TextChunk(first, 0, "Hello", True) in events
    (broken,) = [e for e in events if isinstance(e, StreamBroken)]
    assert broken.repaired and broken.view.job_id == first and "holds a string" in broken.reason
    assert isinstance(events[-1], Followed)


def test_follow_says_when_the_stream_is_not_the_results_text(client, redis_server):
    """Entries placed where the head's would go but holding other text cannot be taken back once printed: the
    follower says so (not repaired), and `results --follow` says how to print the result and exits 1."""
    (job,) = enqueue(client, 1)
    text(client, job, "3-0", "Hex")
    finish(client, job, "Hello")
    events = list(client.follow([job], timeout=30))
    assert events[0] == TextChunk(job, 0, "Hex", False)
    assert isinstance(events[1], StreamBroken) and not events[1].repaired
    assert isinstance(events[2], JobEnded) and isinstance(events[3], Followed)
    res = cli(client, redis_server, "results", job, "--follow", "--timeout", "30")
    assert res.exit_code == 1 and "is not its result's" in res.stderr and f"shardflow results {job}" in res.stderr


def test_cli_follow_prints_the_whole_text_of_a_broken_stream(client, redis_server):
    (job,) = enqueue(client, 1)
    text(client, job, "3-0", "Hel")
    client.r.xadd(client.keys.tokens(job), {b"junk": b"1"})
    finish(client, job, "Hello world")
    res = cli(client, redis_server, "results", job, "--follow", "--timeout", "30")
    assert res.exit_code == 0 and res.stdout == "[0] Hello world\n", res.output
    assert "holds entries that do not continue its text (1); the rest of its text is from its result" in res.stderr


# --- the views race (issue 25): a job that finishes between two reads ------------------------------------------
def after_first_round_trip(monkeypatch: pytest.MonkeyPatch, r: redis.Redis, fn) -> None:
    """Run fn() once, right after the first command or pipeline `r` sends (what a head finishing a job in
    between a reader's round trips would do)."""
    fired = [False]

    def then(result):
        if not fired[0]:
            fired[0] = True
            fn()
        return result

    command, pipeline = r.execute_command, r.pipeline
    monkeypatch.setattr(r, "execute_command", lambda *a, **k: then(command(*a, **k)))

    def wrapped_pipeline(*a, **k):
        pipe = pipeline(*a, **k)
        execute = pipe.execute
        pipe.execute = lambda *ea, **ek: then(execute(*ea, **ek))  # type: ignore[method-assign]
        return pipe

    monkeypatch.setattr(r, "pipeline", wrapped_pipeline)


def test_a_job_finishing_between_reads_is_never_finished_without_its_result(client, monkeypatch):
    """500 concurrent API requests drew 9 answers of 500: `views` read results, then job records, so a job that
    finished in between looked finished with no result. Records are read first now, results after, in one
    round trip: the job is seen still running, then finished with its result."""
    (job,) = enqueue(client, 1)
    set_status(client, job, "started")
    after_first_round_trip(monkeypatch, client.r, lambda: finish(client, job, "done"))
    (view,) = client.views([job])
    assert (view.status, view.result) == ("started", None)
    (view,) = client.views([job])
    assert view.status == "finished" and view.result is not None and view.result["text"] == "done"
