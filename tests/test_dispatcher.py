"""The head's job loop (workers/head/jobs/dispatcher.py): many jobs in flight in one worker, jobs beyond its
capacity wait in the queue, one pool of Redis connections whatever the concurrency."""

from __future__ import annotations

import re

import pytest
from rq.job import Job
from rq.serializers import JSONSerializer

from schemas.keys import Keys
from schemas.requests import DraftSettings, GenerationRequest
from tests.conftest import PROMPTS
from tests.job_env import Env, reference


def _most_in_flight(env: Env, ids: list[str]) -> int:
    spans = [(j.started_at, j.ended_at) for j in Job.fetch_many(ids, connection=env.r, serializer=JSONSerializer)]
    return max(sum(a <= t < b for a, b in spans) for t, _ in spans)


def _prompts(n: int) -> list[str]:
    return [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(n)]


def test_jobs_beyond_capacity_wait_and_all_equal_generate(
    models, redis_server, redis_client, tmp_path, hf_models, tokenizers
):
    """12 jobs on a head with room for 4: their generations run 4 at a time (never more: a job whose generation
    ended makes room while its result is stored, so RQ's spans of started to ended may overlap a fifth), and every
    output equals HF `generate` (greedy, n-gram drafts)."""
    e = Env("cap4", models, redis_server, redis_client, tmp_path, head_extra=("--concurrency", "4"), verbose=True)
    try:
        prompts = _prompts(12)
        reqs = [GenerationRequest(prompt=p, chat_template=False, max_new_tokens=10) for p in prompts]
        ids = e.client.enqueue(reqs).job_ids
        views = e.client.wait(ids, timeout=240)
        tok = tokenizers["qwen2"]
        for p, v in zip(prompts, views, strict=True):
            assert v.status == "finished", v
            assert v.result["token_ids"] == reference(hf_models["qwen2"], tok, p, 10), p
        generating = [int(m) for m in re.findall(r"started \((\d+) generating", (tmp_path / "head.log").read_text())]
        assert len(generating) == 12 and 2 <= max(generating) <= 4  # each counted with its batch, never past 4
        assert _most_in_flight(e, ids) >= 2
    finally:
        e.close()


@pytest.mark.slow
def test_high_concurrency_shares_one_pool(models, redis_server, redis_client, tmp_path, hf_models, tokenizers):
    """A head with room for 96 generations (far past redis-py's default pool of 100 connections, which one
    RQ worker thread per generation exhausted) serves 120 jobs: all finish, equal to HF `generate`, with
    no connection errors in its log."""
    e = Env("cap96", models, redis_server, redis_client, tmp_path, head_extra=("--concurrency", "96"))
    try:
        prompts = _prompts(120)
        draft = DraftSettings(kind="none")
        reqs = [GenerationRequest(prompt=p, chat_template=False, max_new_tokens=4, draft=draft) for p in prompts]
        ids = e.client.enqueue(reqs).job_ids
        views = e.client.wait(ids, timeout=600)
        tok = tokenizers["qwen2"]
        for p, v in zip(prompts, views, strict=True):
            assert v.status == "finished", v
            assert v.result["token_ids"] == reference(hf_models["qwen2"], tok, p, 4), p
        assert _most_in_flight(e, ids) > 16  # far more in flight than one batch of slots by default
        log = (tmp_path / "head.log").read_text()
        assert "Too many connections" not in log and "MaxConnections" not in log
    finally:
        e.close()


@pytest.mark.slow
def test_a_full_tail_makes_heads_wait_not_fail(models, redis_server, redis_client, tmp_path, hf_models, tokenizers):
    """A tail whose static caches hold 2 sessions, a head with 5 jobs in flight: the tail answers the rounds of
    sessions it has no room for "busy" (not dead-lettered), their heads send them again after a wait, and every
    job finishes equal to HF `generate`."""
    e = Env(
        "busy",
        models,
        redis_server,
        redis_client,
        tmp_path,
        tail_extra=["--static-cache", "--slots", "2", "--max-len", "256"],
        head_extra=("--concurrency", "5"),
    )
    try:
        prompts = _prompts(8)
        reqs = [GenerationRequest(prompt=p, chat_template=False, max_new_tokens=12) for p in prompts]
        ids = e.client.enqueue(reqs).job_ids
        views = e.client.wait(ids, timeout=300)
        for p, v in zip(prompts, views, strict=True):
            assert v.status == "finished", v
            assert v.result["token_ids"] == reference(hf_models["qwen2"], tokenizers["qwen2"], p, 12), p
            assert v.result["replays"] == 0  # waiting for room is no replay
        assert _most_in_flight(e, ids) > 2  # more sessions than the tail could hold were under way at once
        assert e.r.xlen(Keys(e.prefix).dead_letters) == 0  # "busy" is an answer, not a refused packet
    finally:
        e.close()


def test_a_head_takes_a_sixteenth_more_jobs_than_slots_to_seat_freed_ones_at_once(models):
    """By default a head worker's room is its batch slots and `jobs.ahead` more (a sixteenth, at least one): those
    wait on the step loop, and a slot a generation frees is seated at once rather than after a dequeue."""
    from schemas.settings import Settings
    from workers.head.runtime import HeadRuntime

    ms = models["qwen2"]
    runtime = HeadRuntime.load(ms.target, (0, 2), settings=Settings(engine={"slots": 32}))
    assert runtime.engine.slots == 32 and runtime.capacity == 34
    runtime.settings = Settings(engine={"slots": 32}, jobs={"ahead": 0})
    assert runtime.capacity == 32
