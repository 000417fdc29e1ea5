"""Crash recovery with real processes: a tail SIGKILLed while generations are in flight, its sessions
replayed onto a restarted tail or onto another replica, output identical to an uninterrupted run."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from producer.local import spawn_tail
from relay_broker.connection import connect
from relay_broker.embedded import EmbeddedRedis, free_port
from schemas.errors import ReplyTimeout
from schemas.groups import entry_parts
from schemas.keys import Keys
from schemas.packets import Verdict, decode_tail_message
from schemas.requests import GenerationRequest
from tests.conftest import PROMPTS
from tests.job_env import SPLIT, Env, reference
from tests.test_parity import NEW, head_for
from tests.test_parity import reference as parity_reference
from workers.head.generation import Generation

N_NEW = 150
pytestmark = pytest.mark.slow  # kills and restarts real processes (about a minute); CI runs them


def wait_until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def consumer_ready(r, names: Keys, name: str) -> bool:
    """The tail named `name` reads the shared stream (a busy tail's entry there can look idle, so by name)."""
    try:
        return any(c["name"].decode() == name for c in r.xinfo_consumers(names.shared_requests, names.tail_group))
    except Exception:
        return False


def sessions_by_tail(r, names: Keys) -> dict[str, int]:
    """How many live sessions each tail holds, from each session's latest verdict on the heads' reply streams
    (where tails put every reply to a head's sessions, a batch's in one entry)."""
    last: dict[str, Verdict] = {}
    for key in r.scan_iter(match=f"{names.prefix}:reply:*"):
        for _, fields in r.xrange(key):
            for part in entry_parts(fields, max_bytes=1 << 30):
                msg = decode_tail_message(part)
                if isinstance(msg, Verdict):
                    last[msg.session_id] = msg
    held: dict[str, int] = {}
    for msg in last.values():
        if msg.tail_id and msg.finish_reason is None:  # live ones
            held[msg.tail_id] = held.get(msg.tail_id, 0) + 1
    return held


@pytest.mark.parametrize("mode", ["restart", "replica"])
def test_tail_killed_mid_flight_sessions_replay(
    mode, models, redis_server, redis_client, tmp_path, hf_models, tokenizers
):
    e = Env(f"tailkill-{mode}", models, redis_server, redis_client, tmp_path, head_extra=("--concurrency", "5"))
    names = Keys(e.prefix)
    try:
        if mode == "replica":  # a second tail replica is up from the start; nothing is restarted
            e.procs["tail2"] = spawn_tail(
                e.ms.target, (SPLIT, e.ms.n_layers), e.url, prefix=e.prefix, name="replica2", extra=["--threads", "1"]
            )
            wait_until(lambda: consumer_ready(e.r, names, "replica2"), 60, "second tail ready")
        prompts = PROMPTS[:5]
        res = e.cli("enqueue", *prompts, "--no-chat-template", "--max-new-tokens", str(N_NEW), "--drafter", "none")
        assert res.exit_code == 0, res.output
        ids = e.client.resolve(res.output.strip())
        wait_until(lambda: all(v.progress for v in e.client.views(ids)), 60, "all 5 generations running")
        held = sessions_by_tail(e.r, names)
        victim = "tail2" if held.get("replica2", 0) > sum(held.values()) / 2 else "tail"
        assert not any(v.status == "finished" for v in e.client.views(ids)), "kill came too late"
        e.procs[victim].kill()
        e.procs[victim].wait()
        lost = held.get("replica2", 0) if victim == "tail2" else sum(held.values()) - held.get("replica2", 0)
        if mode == "restart":
            e.start_tail()
        wait_until(lambda: all(v.status in ("finished", "failed") for v in e.client.views(ids)), 180, "all done")
        views = e.client.views(ids)
        for p, v in zip(prompts, views, strict=True):
            assert v.status == "finished", v
            assert v.result["token_ids"] == reference(hf_models["qwen2"], tokenizers["qwen2"], p, N_NEW)
        assert lost >= 1 and sum(v.result["replays"] > 0 for v in views) >= lost  # the dead tail's sessions moved
    finally:
        e.close()


def test_redis_restart_with_50_jobs_queued(models, tmp_path, hf_models, tokenizers):
    """Redis (append-only) is killed with 50 jobs queued and restarted: the workers and a waiting
    `shardflow enqueue --wait` reconnect with backoff, no job is lost and every one finishes right."""
    data, port = tmp_path / "redis-data", free_port()
    server = EmbeddedRedis(port=port, data_dir=data, appendonly=True).start()
    e = Env("restart", models, server, connect(server.url), tmp_path)
    try:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(50)]
        args = [*prompts, "--no-chat-template", "--max-new-tokens", "6", "--drafter", "none"]
        waiting = subprocess.Popen(
            [sys.executable, "-m", "producer", "enqueue", *args, "--wait", "--json", "--timeout", "200", *e.opts],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        wait_until(lambda: e.r.keys(f"{e.prefix}:batch:*"), 60, "batch enqueued")
        time.sleep(1.5)  # appendfsync everysec: the queue is on disk
        assert server.proc is not None
        server.proc.kill()  # a crash, not a clean shutdown
        server.proc.wait()
        time.sleep(2.0)  # the workers and the waiting CLI notice
        server = EmbeddedRedis(port=port, data_dir=data, appendonly=True).start()
        out, err = waiting.communicate(timeout=240)
        assert waiting.returncode == 0, err[-2000:]  # the waiting CLI rode out the restart
        jobs = json.loads(out)["jobs"]
        assert [j["status"] for j in jobs] == ["finished"] * 50
        refs = {p: reference(hf_models["qwen2"], tokenizers["qwen2"], p, 6) for p in set(prompts)}
        assert [j["result"]["token_ids"] for j in jobs] == [refs[p] for p in prompts]
        assert e.procs["tail"].poll() is None and e.procs["head"].poll() is None  # both rode it out
    finally:
        e.close()
        server.stop()


def test_replay_before_any_token_is_a_fresh_first_round(models, hf_models, tokenizers, tails, redis_client):
    """A tail lost during a generation's first round: the resend is a plain first round (there is no
    generated token for a replay check to reproduce), and the output is still exact."""
    ms = models["qwen2"]
    names = tails.get(ms.target, SPLIT, ms.n_layers)
    runtime = head_for(ms, SPLIT, ms.drafter)
    req = GenerationRequest(prompt=PROMPTS[0], max_new_tokens=NEW, chat_template=False)
    loop = Generation(
        req=req,
        runtime=runtime,
        r=redis_client,
        names=names,
        session_id="replay-first-round",
        prompt=runtime.prompt_ids(req),
        on_tokens=None,
        reply_timeout_s=None,
    )
    loop._replay(ReplyTimeout("tail lost (test)"))
    assert not loop.replay_next and loop.pending == loop.committed == runtime.prompt_ids(req)
    result = loop.run()
    assert result.token_ids == parity_reference("qwen2", hf_models["qwen2"], tokenizers["qwen2"])[0]
    assert result.replays == 1


def test_worker_restart_ends_its_own_stale_record(redis_client, monkeypatch):
    """A head worker whose loop lost Redis could not record its end; a Redis restored from disk still
    lists it as alive. Restarting must end that record instead of failing on RQ's 'name taken' check."""
    from workers.head.jobs.rq_worker import HeadWorker

    worker = HeadWorker(["stale-q"], None, redis_client, name="stale-worker")
    worker.register_birth()  # the record a lost loop leaves behind: alive, no death date
    with pytest.raises(ValueError, match="active worker"):
        HeadWorker(["stale-q"], None, redis_client, name="stale-worker").register_birth()
    worker._restarted = True  # what the loop sets when it restarts after an error
    worker.register_birth()  # the restarted loop starts: its own stale record is ended first
    worker.register_death()
