"""Token streams that another client breaks (issue 24, case 5), on a Redis without ACLs (where anyone can): a
SET on a running job's stream failed the job on every retry (WRONGTYPE), and one XADD with an automatic id
made Redis refuse the head's later entries while the head ignored the error, so `results --follow` printed a
truncated text and exited 0. Now the generation never fails because of its stream: the head reports the
break (log, meta, the result's `stream_broken`) and stops writing, and followers print the whole text from
the stored result, saying so. (Under the ACL file producers cannot write token streams at all: tests/test_acl.py.)"""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest
from rq.job import Job
from rq.serializers import JSONSerializer

from producer.client import Client, Followed, StreamBroken, TextChunk
from relay_broker.connection import connect
from schemas.keys import Keys
from schemas.requests import GenerationResult, RoundTimings
from tests.conftest import PROMPTS
from tests.job_env import Env, reference
from workers.head.jobs.flushes import FlushPool
from workers.head.jobs.job_function import finish
from workers.head.jobs.progress import Progress


class Chars:
    """A tokenizer whose token i is one letter."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def progress(r, name: str) -> Progress:
    job = SimpleNamespace(id=name, key=f"{name}:job:{name}", meta={}, serializer=JSONSerializer)
    return Progress(job, r, Keys(prefix=name), Chars(), 600, 0.2, FlushPool(r, 1, name))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("attack", "why"),
    [
        (lambda r, key: r.set(key, "junk"), "a key of another type"),
        (lambda r, key: r.xadd(key, {b"junk": b"1"}), "an entry past its text"),
    ],
    ids=["set", "xadd-auto-id"],
)
def test_a_broken_stream_is_reported_once_and_never_raised(redis_client, attack, why):
    p = progress(redis_client, f"broken-{why.split()[-1]}")
    stream = p.keys.tokens(p.job.id)
    p.flush([0, 1], final=False)
    attack(redis_client, stream)
    before = redis_client.type(stream), redis_client.xlen(stream) if redis_client.type(stream) == b"stream" else 0
    p.flush([0, 1, 2], final=False)  # refused: reported, not raised
    assert p.stream_broken is not None and why in p.stream_broken
    assert p.job.meta["stream_broken"] == p.stream_broken
    p.flush([0, 1, 2, 3], final=False)  # written no more; the checkpoint and meta still are
    after = redis_client.type(stream), redis_client.xlen(stream) if redis_client.type(stream) == b"stream" else 0
    assert after == before
    assert json.loads(redis_client.get(p.keys.checkpoint(p.job.id)))["token_ids"] == [0, 1, 2, 3]


def test_a_flush_sent_again_is_no_break(redis_client):
    """redis-py sends a pipeline again after a dropped connection: Redis refuses the repeated entry id, and the
    stream's last entry is that very entry, so nothing broke."""
    p = progress(redis_client, "resent")
    p.flush([0, 1], final=False)
    p.flushed_chars = 0  # as if the reply was lost and the same pipeline ran again
    p.flush([0, 1], final=False)
    p.flush([0, 1, 2], final=True)
    assert p.stream_broken is None and "stream_broken" not in p.job.meta


def test_a_stream_broken_at_the_last_write_is_said_in_the_stored_result(redis_client):
    """The break shows only when the end marker is refused: the result just stored is amended to say so."""
    p = progress(redis_client, "broken-last")
    p.flush([0, 1], final=False)
    redis_client.xadd(p.keys.tokens(p.job.id), {b"junk": b"1"})
    result = GenerationResult(
        session_id="s",
        text="abc",
        token_ids=[0, 1, 2],
        finish_reason="length",
        prompt_tokens=1,
        completion_tokens=3,
        rounds=3,
        drafted_tokens=0,
        accepted_tokens=0,
        mean_accepted=0.0,
        tokens_per_round=1.0,
        tokens_per_s=1.0,
        timings=RoundTimings(),
    )
    ctx = SimpleNamespace(r=redis_client, names=p.keys, flusher=p.pool)
    data = finish(ctx, p.job, p, result, 600)  # type: ignore[arg-type]
    stored = GenerationResult.model_validate_json(redis_client.get(p.keys.result(p.job.id)))
    assert data["stream_broken"] == stored.stream_broken == p.stream_broken is not None
    assert stored.text == "abc" and "stream_broken" in json.loads(redis_client.hget(p.job.key, "meta"))


def test_a_result_stored_before_the_field_existed_still_reads(redis_client):
    old = GenerationResult.model_validate_json(
        '{"v": 1, "session_id": "s", "text": "x", "token_ids": [1], "finish_reason": "eos", "prompt_tokens": 1,'
        '"completion_tokens": 1, "rounds": 1, "drafted_tokens": 0, "accepted_tokens": 0, "mean_accepted": 0.0,'
        '"tokens_per_round": 1.0, "tokens_per_s": 1.0, "timings": {}, "resumed_tokens": 0, "replays": 0}'
    )
    assert old.stream_broken is None


# --- end to end: a real head and tail; the attack lands while the job runs -----------------------------------
N = 300  # tokens: PROMPTS[1] runs this long on the tiny model (no EOS), long enough to strike mid-job


@pytest.fixture(scope="module")
def env(models, redis_server, redis_client, tmp_path_factory):
    e = Env("streams", models, redis_server, redis_client, tmp_path_factory.mktemp("streams"))
    yield e
    e.close()


def run_broken(env: Env, attack) -> tuple[str, list]:
    """A job of N tokens followed by a Client on a thread; `attack(r, stream)` once its first text is out.
    (the job id, the events followed)"""
    res = env.cli(
        "enqueue", PROMPTS[1], "--no-chat-template", "--max-new-tokens", str(N), "--drafter", "none", "--retries", "0"
    )
    (jid,) = env.client.resolve(res.output.strip())
    events: list = []
    first_text = threading.Event()

    def follow() -> None:
        r = connect(env.url)
        for event in Client(r, prefix=env.prefix, queue=env.queue).follow([jid], timeout=180):
            events.append(event)
            if isinstance(event, TextChunk) and event.text:
                first_text.set()
        r.close()

    follower = threading.Thread(target=follow, daemon=True)
    follower.start()
    assert first_text.wait(120), events
    attack(env.r, f"{env.prefix}:tokens:{jid}")
    follower.join(180)
    assert not follower.is_alive()
    return jid, events


@pytest.mark.parametrize(
    ("attack", "why"),
    [
        (lambda r, key: r.set(key, "junk"), "a key of another type"),
        (lambda r, key: r.xadd(key, {b"text": b"junk", b"final": b"1"}), "an entry past its text"),
    ],
    ids=["set", "xadd-auto-id"],
)
def test_a_job_whose_stream_was_broken_finishes_identical_and_followers_print_it_all(
    env, hf_models, tokenizers, attack, why
):
    jid, events = run_broken(env, attack)
    (view,) = env.client.views([jid])
    assert view.status == "finished", view
    assert view.result["token_ids"] == reference(hf_models["qwen2"], tokenizers["qwen2"], PROMPTS[1], N)
    assert why in (view.result["stream_broken"] or ""), view.result["stream_broken"]  # it broke mid-job
    assert Job.fetch(jid, connection=env.r, serializer=JSONSerializer).meta["stream_broken"]
    log = (env.tmp / "head.log").read_text()
    assert log.count(f"job {jid}: the token stream broke") == 1  # said once, then written no more

    # the live follower: the whole text, and that the stream broke
    assert "".join(e.text for e in events if isinstance(e, TextChunk)) == view.result["text"]
    broken = [e for e in events if isinstance(e, StreamBroken)]
    assert len(broken) == 1 and broken[0].repaired and isinstance(events[-1], Followed)
    # a follower that comes later, through the CLI: the same, on stderr a note, exit 0
    res = env.cli("results", jid, "--follow", "--timeout", "60")
    assert res.exit_code == 0 and res.stdout == f"[0] {view.result['text']}\n", res.output
    assert f"note: [0] {jid}: the token stream broke" in res.stderr
