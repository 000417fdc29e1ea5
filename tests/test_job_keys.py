"""What jobs leave in Redis, end to end with real tail and head worker processes: every key a job writes
expires with its `--result-ttl`, and the keys other clients can write (token streams, result records, job
records, the announced model) are read defensively: a bad entry is skipped or reported, never a crash."""

from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest
from rq import Queue
from rq.serializers import JSONSerializer

from schemas.jobs import RUN_GENERATION
from schemas.settings import Settings
from tests.job_env import Env

TTL = 60


@pytest.fixture(scope="module")
def env(models, redis_server, redis_client, tmp_path_factory):
    e = Env("keys", models, redis_server, redis_client, tmp_path_factory.mktemp("keys"))
    yield e
    e.close()


def _keys_of(env: Env, batch: str) -> dict[str, int]:
    """Every key whose name holds the batch id, with its TTL."""
    return {k.decode(): env.r.ttl(k) for k in env.r.keys(f"*{batch}*")}


def _wait_final(env: Env, batch: str, timeout: float = 60) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        views = json.loads(env.cli("status", batch, "--json").output)["jobs"]
        if all(v["status"] in ("finished", "failed", "canceled") for v in views):
            return views
        time.sleep(0.2)
    pytest.fail(f"batch {batch} did not finish")


def test_every_key_a_job_writes_expires_with_its_result_ttl(env):
    args = ["--no-chat-template", "--result-ttl", str(TTL)]
    done = env.cli("enqueue", "Hello world!", "Tokyo", *args, "--max-new-tokens", "6", "--wait", "--json")
    assert done.exit_code == 0, done.output
    batch = json.loads(done.output.splitlines()[-1])["batch_id"]
    # a second batch whose running job is cancelled: it is canceled, and what it left expires the same way
    res = env.cli("enqueue", "one", *args, "--max-new-tokens", "1500", "--drafter", "none", "--retries", "0")
    cancelled = res.output.strip()
    deadline = time.monotonic() + 60
    while not env.r.exists(f"{env.prefix}:tokens:{cancelled}-00000") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert env.cli("cancel", cancelled).exit_code == 0
    assert [v["status"] for v in _wait_final(env, cancelled)] == ["canceled"]

    for b, jobs in ((batch, 2), (cancelled, 1)):
        keys = _keys_of(env, b)
        for i in range(jobs):
            jid = f"{b}-{i:05d}"
            rq_result = {f"rq:results:{jid}"} if b == batch else set()  # RQ keeps no result of a canceled job
            assert {f"rq:job:{jid}", f"{env.prefix}:tokens:{jid}"} | rq_result <= set(keys), keys
        assert f"{env.prefix}:batch:{b}" in keys and (b == cancelled) == (f"{env.prefix}:ckpt:{b}-00000" in keys)
        # RQ's group of the batch is RQ's own index (no TTL): its maintenance removes it with the last job
        expiring = {k: t for k, t in keys.items() if k != f"rq:group:{b}"}
        assert all(0 < t <= TTL for t in expiring.values()), expiring
    result_keys = [k for k in _keys_of(env, batch) if k.startswith(f"{env.prefix}:result:")]
    assert len(result_keys) == 2

    # once the batch record is gone (a queue that waited longer than the TTL), RQ's group still lists it
    env.r.delete(f"{env.prefix}:batch:{batch}")
    status = json.loads(env.cli("status", batch, "--json").output)
    assert status["counts"] == {"finished": 2}


@pytest.mark.parametrize("ttl", ["0", "-5"])
def test_a_result_ttl_below_one_second_is_refused(env, ttl):
    res = env.cli("enqueue", "Hello", "--result-ttl", ttl)
    assert res.exit_code == 2 and "Traceback" not in res.output


def test_junk_in_keys_others_can_write_is_skipped(env):
    """A token stream, a stored result, a job record and the announced model, each holding junk."""
    model_key = f"{env.prefix}:model:{env.queue}"
    announced = env.r.get(model_key)
    env.r.set(model_key, b"\xff not json")
    try:
        res = env.cli("enqueue", "Hello world!", "Tokyo", "--no-chat-template", "--max-new-tokens", "8")
    finally:
        env.r.set(model_key, announced)
    assert res.exit_code == 0, res.output
    batch = res.output.strip()
    first, second = f"{batch}-00000", f"{batch}-00001"
    env.r.xadd(f"{env.prefix}:tokens:{first}", {b"junk": b"\xff\xfe"}, id="0-1")  # before the head's own ids
    follow = env.cli("results", batch, "--follow", "--timeout", "60")
    assert follow.exit_code == 0, follow.output
    views = env.client.views(env.client.resolve(batch))
    assert all(v.status == "finished" for v in views) and views[0].result["text"] in follow.output

    env.r.set(f"{env.prefix}:result:{second}", b"{not json")
    env.r.hset(f"rq:job:{first}", mapping={"meta": b"\x00\xff", "status": b"no-such-status"})
    status = env.cli("status", batch, "--json")
    assert status.exit_code == 0, status.output
    jobs = json.loads(status.output)["jobs"]
    assert jobs[0]["status"] == "unknown" and "unreadable job record" in jobs[0]["error"]
    assert jobs[1]["result"] is None and jobs[1]["error"] == "unreadable result record"
    assert env.cli("results", batch).exit_code == 0


def test_forged_job_records_never_stop_the_head(env):
    """Anyone who can write RQ's keys can queue a job id whose record does not restore (a bad date), or does
    but cannot run (bad data), name a rate limit (RQ would run Lua for it), sit abandoned in a registry, or
    not be a hash at all: the head fails or skips each the usual way, its loop never ends on one, and it
    serves the next job."""
    for jid, record in (
        ("forged-meta", {"meta": b"\x00\xff not json", "data": b"[]", "status": b"queued"}),
        ("forged-data", {"data": b"\xff\xfe", "status": b"queued", "created_at": b"not a date"}),
    ):
        env.r.hset(f"rq:job:{jid}", mapping=record)
        env.r.rpush(f"rq:queue:{env.queue}", jid)
    env.r.set("rq:job:forged-string", "not a hash")
    env.r.rpush(f"rq:queue:{env.queue}", "forged-string")
    limited = Queue(f"{env.queue}-idle", connection=env.r, serializer=JSONSerializer).enqueue_call(
        RUN_GENERATION, args=({"prompt": "x"},), job_id="forged-limit"
    )
    env.r.hset(limited.key, mapping={"status": "started", "rate_limit_key": "x", "rate_limit_concurrency": "1"})
    env.r.hset(limited.key, "origin", env.queue)
    env.r.zadd(f"rq:wip:{env.queue}", {"forged-limit:exec": 1})  # abandoned long ago: maintenance fails it
    res = env.cli("enqueue", "Tokyo", "--no-chat-template", "--max-new-tokens", "4", "--wait", "--timeout", "60")
    assert res.exit_code == 0, res.output
    deadline = time.monotonic() + 30
    while env.r.hget("rq:job:forged-limit", "status") != b"failed" and time.monotonic() < deadline:
        time.sleep(0.2)
    log = (env.tmp / "head.log").read_text()
    assert env.procs["head"].poll() is None and "unhandled exception" not in log and "restarting" not in log
    for jid in ("forged-meta", "forged-data", "forged-limit"):
        assert env.r.hget(f"rq:job:{jid}", "status") == b"failed", jid
        assert 0 < env.r.ttl(f"rq:job:{jid}") <= Settings().jobs.result_ttl_s, jid  # kept like any failed job
    assert "ignoring the rate limit" in log and "NOPERM" not in log


def test_a_forged_scheduled_entry_holds_back_no_retry(env):
    """Due entries of RQ's scheduled registry (where retries wait out their backoff) that do not restore, or
    are no job at all, never keep the head's scheduler from enqueueing the real ones."""
    env.r.hset("rq:job:forged-sched", mapping={"data": b"[]", "created_at": b"not a date", "status": b"scheduled"})
    env.r.set("rq:job:forged-sched-str", "not a hash")
    env.r.zadd(f"rq:scheduled:{env.queue}", {"forged-sched": 0, "forged-sched-str": 0})
    queue = Queue(env.queue, connection=env.r, serializer=JSONSerializer)
    request = {"prompt": "Tokyo", "chat_template": False, "max_new_tokens": 4}
    job = queue.enqueue_in(timedelta(seconds=0), RUN_GENERATION, request, job_id="real-sched")
    deadline = time.monotonic() + 30
    while env.r.hget(job.key, "status") != b"finished" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert env.r.hget(job.key, "status") == b"finished"
    assert not env.r.zcard(f"rq:scheduled:{env.queue}")  # the forged entries left the registry too
    assert env.r.hget("rq:job:forged-sched", "status") == b"failed"
