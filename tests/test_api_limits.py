"""`shardflow serve`'s limits and batch cancelling, on a serve process of its own with small limits: a body
over the limit is 413, a request past the concurrency limit is 429, both in OpenAI's error shape and with
nothing enqueued; a cancelled batch's jobs stop and it ends `cancelled`, each request an OpenAI cancelled line
(no response, `batch_cancelled`), counted in `failed` with the error file's other lines."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from tests.job_env import Env, batch_line, start_serve, upload_batch, wait_batch

pytestmark = pytest.mark.slow  # a serve process of its own (scripts/test.sh and CI run it)

KEY = "test-key-limits"

HEADERS = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def small(models, redis_server, redis_client, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("api-limits")
    env = Env("apilim", models, redis_server, redis_client, tmp)
    limits = {
        "SHARDFLOW_API__MAX_BODY_BYTES": "4096",
        "SHARDFLOW_API__MAX_CONCURRENT": "1",
        "SHARDFLOW_API__MODEL_NAME": "tiny",
    }
    proc, base = start_serve(env, tmp / "serve.log", KEY, limits)
    yield SimpleNamespace(env=env, base=base, client=openai.OpenAI(base_url=base, api_key=KEY, max_retries=0))
    proc.terminate()
    proc.wait(20)
    env.close()


def batches(small) -> list[bytes]:
    return small.env.r.keys(f"{small.env.prefix}:batch:*")


def test_a_body_over_the_limit_is_413(small):
    before = batches(small)
    body = {"model": "tiny", "prompt": "x" * 8000, "max_tokens": 1}
    r = httpx.post(f"{small.base}/completions", json=body, headers=HEADERS)
    assert r.status_code == 413 and "over 4096 bytes" in r.json()["error"]["message"]
    assert batches(small) == before


def test_requests_past_the_limit_are_429(small):
    """One long streamed request holds the only slot; a second is refused at once, then served once it ends."""
    body = {"model": "tiny", "prompt": "Tokyo", "max_tokens": 200, "temperature": 0, "stream": True}
    started, done = threading.Event(), threading.Event()

    def long_request() -> None:
        with httpx.stream("POST", f"{small.base}/completions", json=body, headers=HEADERS, timeout=120) as r:
            for _ in r.iter_lines():
                started.set()
        done.set()

    t = threading.Thread(target=long_request, daemon=True)
    t.start()
    assert started.wait(60)
    with pytest.raises(openai.RateLimitError):
        small.client.completions.create(model="tiny", prompt="x", max_tokens=1, temperature=0)
    assert done.wait(120)
    t.join(10)
    got = small.client.completions.create(model="tiny", prompt="Tokyo", max_tokens=2, temperature=0)
    assert got.usage.completion_tokens == 2


def test_a_cancelled_batch_stops(small, tmp_path):
    lines = [batch_line(f"c{i}", prompt="Tokyo", max_tokens=1500) for i in range(3)]
    batch = upload_batch(small.client, tmp_path / "in.jsonl", lines)
    time.sleep(1.0)  # let the head start them
    batch = small.client.batches.cancel(batch.id)
    assert batch.status in ("cancelling", "cancelled")
    batch = wait_batch(small.client, batch, "cancelled", 60)
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (3, 0, 3)  # failed: the lines of the error file
    assert batch.error_file_id and batch.output_file_id is None and batch.cancelled_at and batch.cancelling_at
    assert batch.completed_at is None
    errors = [json.loads(x) for x in small.client.files.content(batch.error_file_id).text.splitlines()]
    assert sorted(x["custom_id"] for x in errors) == ["c0", "c1", "c2"]
    for x in errors:  # OpenAI's line for a request its batch's cancelling stopped: no response, no 500
        assert x["response"] is None and x["error"]["code"] == "batch_cancelled", x
    (view,) = small.env.client.views([errors[0]["id"].removeprefix("batch_req_")])
    assert view.status == "canceled"  # in RQ too, never failed
