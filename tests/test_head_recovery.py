"""A SIGKILLed head's sessions are freed fast (issue 24): the tail's 16 slots are all held by the dead head's
sessions; the next head's jobs (the dead head's, retried from their checkpoints) get the slots once the dead
head has been silent for its reply timeout, not after the tail's idle expiry (session_ttl_s, 600 s: before,
throughput fell to about 1/40 for ten minutes)."""

from __future__ import annotations

import signal
import time

import pytest

from tests.job_env import Env, head_worker, reference
from tests.test_dispatcher import _prompts

N, NEW = 16, 240


@pytest.mark.slow
def test_a_killed_heads_sessions_are_freed_for_the_next_head(
    models, redis_server, redis_client, tmp_path, hf_models, tokenizers
):
    e = Env(
        "headkill",
        models,
        redis_server,
        redis_client,
        tmp_path,
        tail_extra=["--static-cache", "--slots", str(N), "--max-len", "512"],
        head_extra=("--concurrency", str(N)),
    )
    try:
        prompts = _prompts(N)
        out = e.cli("enqueue", *prompts, "--no-chat-template", "--max-new-tokens", str(NEW), "--drafter", "none")
        ids = e.client.resolve(out.output.strip())
        deadline = time.monotonic() + 120
        while sum(bool(v.progress) for v in e.client.views(ids)) < N and time.monotonic() < deadline:
            time.sleep(0.05)
        e.procs["head"].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        e.procs["head2"] = head_worker(
            e.ms.target, e.url, e.queue, e.prefix, tmp_path / "head2.log", "headkill-h2", ("--concurrency", str(N))
        )
        views = e.client.wait(ids, timeout=150)  # before: the tail answered "busy" for 600 s
        took = time.monotonic() - killed
        assert all(v.status == "finished" for v in views), [v.status for v in views]
        for p, v in zip(prompts[:4], views, strict=False):
            assert v.result["token_ids"] == reference(hf_models["qwen2"], tokenizers["qwen2"], p, NEW)
        print(f"\n{N} jobs of a SIGKILLed head finished {took:.1f}s after the kill")
        tail_log = (tmp_path / "tail.log").read_text()
        assert "their head headkill-h1 was silent" in tail_log, tail_log[-2000:]
    finally:
        e.close()
