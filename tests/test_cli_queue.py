"""The CLI on a queue of its own in the session's Redis, with no head worker process: `--wait` and `--follow` say
on stderr within seconds that no head is live to run the jobs and keep waiting (until `--timeout`, whose error
says it too), and say nothing while a head is live; `shardflow info --queue X` shows X alone, its workers and its
jobs. A head's liveness is its RQ worker record's heartbeat (producer/liveness.py), written here by hand."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
from click.testing import CliRunner, Result
from rq.worker_registration import REDIS_WORKER_KEYS, WORKERS_BY_QUEUE_KEY

from producer.cli import main
from producer.client import Client
from producer.head_watch import HeadWatch
from producer.liveness import BEAT_FORMAT
from relay_broker.connection import connect
from schemas.requests import GenerationRequest


@pytest.fixture(autouse=True)
def quick_watch(monkeypatch) -> None:
    """The watch's first look after 0.3 s, not 2 (the tests wait a second, not three)."""
    monkeypatch.setattr("producer.head_watch.GRACE_S", 0.3)
    monkeypatch.setattr("producer.head_watch.EVERY_S", 0.1)


@pytest.fixture
def names() -> tuple[str, str]:
    """A queue and prefix of this test's own."""
    name = uuid.uuid4().hex[:8]
    return f"q-cli-{name}", f"p-cli-{name}"


def cli(url: str, queue: str, prefix: str, *args: str) -> Result:
    return CliRunner().invoke(main, [*args, "--queue", queue, "--prefix", prefix, "--redis-url", url])


def enqueue(url: str, queue: str, prefix: str, n: int = 1) -> str:
    """A batch of n jobs on the queue (nobody runs them); its id."""
    client = Client(connect(url), prefix=prefix, queue=queue)
    return client.enqueue([GenerationRequest(prompt=f"prompt {i}") for i in range(n)]).batch_id


@pytest.fixture
def workers(redis_client) -> Iterator:
    """fake(name, queue, beat_ago_s): an RQ worker record on the queue, as a head's would be (a heartbeat
    `beat_ago_s` old); every one is deleted after the test."""
    made: list[tuple[str, str]] = []

    def fake(name: str, queue: str, beat_ago_s: float = 0.0) -> None:
        key = f"rq:worker:{name}"
        stamp = datetime.fromtimestamp(datetime.now(UTC).timestamp() - beat_ago_s, UTC).strftime(BEAT_FORMAT)
        redis_client.hset(key, mapping={"last_heartbeat": stamp, "queues": queue, "state": "idle"})
        redis_client.sadd(REDIS_WORKER_KEYS, key)
        redis_client.sadd(WORKERS_BY_QUEUE_KEY % queue, key)
        made.append((key, queue))

    yield fake
    for key, queue in made:
        redis_client.delete(key)
        redis_client.srem(REDIS_WORKER_KEYS, key)
        redis_client.srem(WORKERS_BY_QUEUE_KEY % queue, key)


WAITS = {
    "enqueue --wait": lambda batch: ("enqueue", "Hello", "--wait"),
    "results --wait": lambda batch: ("results", batch, "--wait"),
    "results --follow": lambda batch: ("results", batch, "--follow"),
    "results --follow --format openai": lambda batch: ("results", batch, "--follow", "--format", "openai"),
}


@pytest.mark.parametrize("how", list(WAITS))
def test_a_wait_with_no_live_head_says_so_and_keeps_waiting(redis_server, names, how):
    queue, prefix = names
    batch = enqueue(redis_server.url, queue, prefix)
    res = cli(redis_server.url, queue, prefix, *WAITS[how](batch), "--timeout", "1")
    why = f"no head worker is running for queue {queue} (start one: shardflow head)"
    lines = res.stderr.splitlines()
    assert res.exit_code == 5, res.output
    assert lines.count(f"warning: {why}; still waiting, for up to 1s (--timeout) (Ctrl-C to stop)") == 1, lines
    assert lines[-1].startswith("error: timed out after 1s (1 queued); " + why), lines


def test_a_head_that_stopped_beating_is_said_with_its_last_heartbeat(redis_server, names, workers):
    queue, prefix = names
    workers(f"dead-{queue}", queue, beat_ago_s=60)
    batch = enqueue(redis_server.url, queue, prefix)
    res = cli(redis_server.url, queue, prefix, "results", batch, "--wait", "--timeout", "1")
    assert res.exit_code == 5, res.output
    said = rf"warning: no head worker is alive for queue {queue} \(the last heartbeat was 6\ds ago\); still waiting"
    assert re.search(said, res.stderr), res.stderr


def test_a_wait_with_a_live_head_says_nothing_of_heads(redis_server, names, workers):
    queue, prefix = names
    workers(f"live-{queue}", queue)  # beat just now: live for heartbeat_ttl_s (8 s), past this wait
    batch = enqueue(redis_server.url, queue, prefix)
    res = cli(redis_server.url, queue, prefix, "results", batch, "--wait", "--timeout", "1")
    assert res.exit_code == 5, res.output
    assert "head worker" not in res.stderr and res.stderr.splitlines()[-1] == "error: timed out after 1s (1 queued)"


def test_the_watch_says_once_that_no_head_is_live_and_when_one_comes(redis_server, names, workers):
    queue, prefix = names
    said: list[str] = []
    watch = HeadWatch(Client(connect(redis_server.url), prefix=prefix, queue=queue), say=said.append)
    for live in (False, False, True, True):
        if live:
            workers(f"late-{queue}", queue)
        watch.liveness.forget()  # each look reads Redis (not the last look, trusted for api.liveness_s)
        watch.look()
    why = f"no head worker is running for queue {queue} (start one: shardflow head)"
    assert said == [f"warning: {why}; still waiting (Ctrl-C to stop)", f"note: a head worker now serves queue {queue}"]
    assert watch.note() == ""


def test_info_shows_the_queue_asked_for_alone(redis_server, names, workers):
    queue, prefix = names
    other = f"{queue}-other"
    enqueue(redis_server.url, queue, prefix, 1)
    enqueue(redis_server.url, other, prefix, 2)
    workers(f"w-{queue}", queue)
    workers(f"w-{other}", other)
    data = json.loads(cli(redis_server.url, queue, prefix, "info", "--json").output)
    assert [(q["queue"], q["queued"], q["workers"]) for q in data["queues"]] == [(queue, 1, 1)]
    assert [w["name"] for w in data["workers"]] == [f"w-{queue}"]
    text = cli(redis_server.url, queue, prefix, "info").output
    assert text.startswith(f"queue {queue}: 1 queued, 0 started") and f"worker w-{queue}: idle on {queue}" in text
    assert other not in text
    unused = f"{queue}-never"  # a queue nothing was ever enqueued on: shown, empty, not left out
    data = json.loads(cli(redis_server.url, unused, prefix, "info", "--json").output)
    assert [(q["queue"], q["queued"], q["workers"]) for q in data["queues"]] == [(unused, 0, 0)]
    assert data["workers"] == []
    assert f"no worker serves queue {unused}" in cli(redis_server.url, unused, prefix, "info").output
    status = cli(redis_server.url, queue, prefix, "status").output  # no target: the queue too
    assert status.startswith(f"{queue}: 1 queued") and other not in status
