"""Cancellations are not failures (issue 25, case 4): a running job that its user cancels (`shardflow cancel`,
or a client of `shardflow serve` that goes away) was stopped by its head and recorded `failed` by RQ, and
`shardflow info` counted it among the failures. Now it is `canceled` everywhere (RQ's status and canceled
registry, `info`, `status`), as a cancelled queued job always was, and `shardflow retry` still resumes it
from its checkpoint."""

from __future__ import annotations

import json
import time

import pytest
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer

from schemas.settings import Settings
from tests.conftest import PROMPTS
from tests.job_env import Env, reference

N = 300  # tokens: PROMPTS[1] runs this long on the tiny model (no EOS)


@pytest.fixture(scope="module")
def env(models, redis_server, redis_client, tmp_path_factory):
    e = Env("cancel", models, redis_server, redis_client, tmp_path_factory.mktemp("cancel"))
    yield e
    e.close()


def until(condition, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_a_cancelled_running_job_is_canceled_never_failed_and_retry_resumes_it(env, hf_models, tokenizers):
    res = env.cli("enqueue", PROMPTS[1], "--no-chat-template", "--max-new-tokens", str(N), "--drafter", "none")
    batch = res.output.strip()
    (jid,) = env.client.resolve(batch)
    until(lambda: env.client.views([jid])[0].progress)  # running, a checkpoint written
    assert env.cli("cancel", batch).output.strip() == "cancelled 1 job(s)"
    until(lambda: env.client.views([jid])[0].status != "started")

    job = Job.fetch(jid, connection=env.r, serializer=JSONSerializer)
    queue = Queue(env.queue, connection=env.r, serializer=JSONSerializer)
    assert job.get_status() == "canceled" and job.ended_at is not None
    assert jid in queue.canceled_job_registry
    assert jid not in queue.failed_job_registry and jid not in queue.started_job_registry
    assert 0 < env.r.ttl(job.key) <= Settings().jobs.result_ttl_s  # kept as long as a failed job would be
    assert env.r.hget("rq:worker:cancel-h1", "failed_job_count") in (None, b"0")
    assert env.r.exists(f"{env.prefix}:ckpt:{jid}")

    info = json.loads(env.cli("info", "--json").output)
    counts = next(q for q in info["queues"] if q["queue"] == env.queue)
    assert (counts["canceled"], counts["failed"], counts["started"]) == (1, 0, 0)
    assert "0 failed, 1 canceled" in env.cli("info").output
    assert "0 failed, 1 canceled" in env.cli("status").output
    status = env.cli("status", batch)
    assert f"{batch}: 1 canceled" in status.output and "failed" not in status.output, status.output
    assert json.loads(env.cli("status", batch, "--json").output)["jobs"][0]["error"] is None

    retried = env.cli("retry", batch)
    assert retried.exit_code == 0 and retried.output.split()[-1] == jid, retried.output
    assert jid not in queue.canceled_job_registry
    (view,) = env.client.wait([jid], timeout=120)
    assert view.status == "finished", view
    assert view.result["token_ids"] == reference(hf_models["qwen2"], tokenizers["qwen2"], PROMPTS[1], N)
    assert 0 < view.result["resumed_tokens"] < N  # from the checkpoint the cancelled attempt left
    assert view.result["stream_broken"] is None
    # the retried attempt went on with the token stream the cancelled one left: it holds the whole text
    follow = env.cli("results", batch, "--follow", "--timeout", "60")
    assert follow.exit_code == 0 and follow.stdout == f"[0] {view.result['text']}\n" and not follow.stderr
