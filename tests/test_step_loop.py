"""One loop owns the sequences (issue 26): 64 jobs in flight on a real head worker process equal HF `generate`,
and the head's thread count does not grow with them (before: a thread per job, one per job's progress
flushes and a timer per job: 772 threads at 256 jobs)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from schemas.requests import DraftSettings, GenerationRequest
from tests.job_env import Env, reference
from tests.test_dispatcher import _most_in_flight, _prompts

N, NEW = 64, 12
MAX_THREADS = 32  # the bound at 256 jobs; the head's own: loop, finishers, flushers, housekeeping, ...


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return 0


@pytest.mark.slow
def test_64_jobs_in_flight_equal_generate_on_a_bounded_number_of_threads(
    models, redis_server, redis_client, tmp_path, hf_models, tokenizers
):
    e = Env(
        "loop64",
        models,
        redis_server,
        redis_client,
        tmp_path,
        tail_extra=["--slots", str(N)],
        head_extra=("--concurrency", str(N)),
    )
    try:
        pid, most, done = e.procs["head"].pid, [_threads(e.procs["head"].pid)], threading.Event()

        def sample() -> None:
            while not done.is_set():
                most.append(_threads(pid))
                time.sleep(0.05)

        sampler = threading.Thread(target=sample)
        sampler.start()
        prompts = _prompts(N)
        kinds = [DraftSettings(kind="model"), DraftSettings(kind="ngram"), DraftSettings(kind="none")]
        reqs = [
            GenerationRequest(prompt=p, chat_template=False, max_new_tokens=NEW, draft=kinds[i % 3])
            for i, p in enumerate(prompts)
        ]
        ids = e.client.enqueue(reqs).job_ids
        views = e.client.wait(ids, timeout=300)
        done.set()
        sampler.join(5)
        tok = tokenizers["qwen2"]
        for p, v in zip(prompts, views, strict=True):
            assert v.status == "finished", v
            assert v.result["token_ids"] == reference(hf_models["qwen2"], tok, p, NEW), p
        assert _most_in_flight(e, ids) >= N // 2  # they really were in flight together
        assert max(most) <= MAX_THREADS, max(most)
        print(f"\n{N} jobs in flight: the head process held at most {max(most)} threads")
    finally:
        e.close()
