"""The job system end to end: real Redis, real tail and head worker processes, the producer CLI."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
from rq import Queue
from rq.serializers import JSONSerializer

from producer.client import Client
from schemas.requests import GenerationRequest
from tests.conftest import PROMPTS
from tests.job_env import Env, head_worker, reference


@pytest.fixture(scope="module")
def env(models, redis_server, redis_client, tmp_path_factory):
    e = Env("main", models, redis_server, redis_client, tmp_path_factory.mktemp("jobs"))
    yield e
    e.close()


def test_jsonl_batch_of_20_equals_generate(env, hf_models, tokenizers, tmp_path):
    lines = [
        {"prompt": p, "max_new_tokens": 8 + i % 5, "chat_template": False, "draft": {"k": 1 + i % 6}}
        for i, p in enumerate(PROMPTS)
    ]
    path = tmp_path / "batch.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "producer",
            "enqueue",
            "--file",
            str(path),
            "--wait",
            "--json",
            "--timeout",
            "180",
            *env.opts,
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert len(data["jobs"]) == 20 and "progress: " in out.stderr  # plain progress lines off a terminal
    for line, job in zip(lines, data["jobs"], strict=True):
        assert job["status"] == "finished"
        want = reference(hf_models["qwen2"], tokenizers["qwen2"], line["prompt"], line["max_new_tokens"])
        assert job["result"]["token_ids"] == want
        assert job["result"]["completion_tokens"] == len(want)
        assert job["progress"]["tokens"] == len(want)
    batch = data["batch_id"]
    status = env.cli("status", batch, "--json")
    assert status.exit_code == 0 and json.loads(status.output)["counts"] == {"finished": 20}
    res = env.cli("results", batch, "--jsonl", "-o", str(tmp_path / "out.jsonl"))
    assert res.exit_code == 0
    rows = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["job_id"] for r in rows] == [f"{batch}-{i:05d}" for i in range(20)]
    assert all(r["result"]["finish_reason"] in ("length", "eos") for r in rows)


def test_follow_streams_text_and_info(env):
    res = env.cli("enqueue", "Hello world! How are you today?", "--no-chat-template", "--max-new-tokens", "12")
    batch = res.output.strip()
    follow = env.cli("results", batch, "--follow", "--timeout", "60")
    assert follow.exit_code == 0 and follow.output.startswith("[0] ")
    view = env.client.views(env.client.resolve(batch))[0]
    assert view.result["text"] in follow.output
    info = env.cli("info", "--json")
    q = next(q for q in json.loads(info.output)["queues"] if q["queue"] == env.queue)
    assert q["workers"] >= 1 and q["finished"] >= 1
    rq_info = subprocess.run(
        [str(Path(sys.executable).parent / "rq"), "info", "--url", env.url, env.queue],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert rq_info.returncode == 0 and env.queue in rq_info.stdout


@pytest.mark.parametrize(
    ("args", "fragment", "code"),
    [
        (["enqueue", ""], "argument 1: prompt is empty", 2),
        (["enqueue", "hi", "--max-new-tokens", "0"], "'--max-new-tokens': 0 is not in the range", 2),  # click's
        (["enqueue", "hi", "--temperature", "-1"], "'--temperature': -1.0 is not in the range", 2),
        (["enqueue", "hi", "--top-p", "0"], "'--top-p': 0.0 is not in the range", 2),
        (["enqueue", "hi", "--top-p", "1.5"], "'--top-p': 1.5 is not in the range", 2),
        (["enqueue", "--file", "/nonexistent/prompts.txt"], "cannot read /nonexistent/prompts.txt", 2),
        (["enqueue", "word " * 2100], "exceeds the model's context of 2048 tokens", 2),
        (["status", "no-such-batch"], "no batch or job 'no-such-batch'", 3),
        (["results", "no-such-batch"], "no batch or job 'no-such-batch'", 3),
    ],
)
def test_bad_input_is_one_clear_line_and_enqueues_nothing(env, args, fragment, code):
    before = sorted(env.r.keys(f"{env.prefix}:batch:*")), Queue(env.queue, connection=env.r).count
    res = env.cli(*args)
    assert res.exit_code == code, res.output
    errors = [ln for ln in res.output.splitlines() if ln.startswith(("error:", "Error:"))]  # ours, click's
    assert len(errors) == 1 and fragment in errors[0], res.output
    assert (sorted(env.r.keys(f"{env.prefix}:batch:*")), Queue(env.queue, connection=env.r).count) == before


def test_bad_jsonl_lines_are_all_reported(env, tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text('{"prompt": "fine"}\n{"prompt": \n\n{"prompt": "x", "top_p": 2}\n{"prompt": "ok"}\n[1]\n')
    before = Queue(env.queue, connection=env.r).count
    res = env.cli("enqueue", "--file", str(path))
    assert res.exit_code == 2
    errors = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
    assert [e.split(":")[1].strip() for e in errors] == ["line 2", "line 4", "line 6"]
    assert "invalid JSON" in errors[0] and "top_p" in errors[1] and "JSON object" in errors[2]
    assert Queue(env.queue, connection=env.r).count == before


def test_stdin_prompts(env):
    res = env.cli(
        "enqueue",
        "-",
        "--no-chat-template",
        "--max-new-tokens",
        "3",
        "--wait",
        "--json",
        input="first prompt\n\nsecond prompt\n",
    )
    assert res.exit_code == 0, res.output
    jobs = json.loads(res.output.splitlines()[-1])["jobs"]
    assert [j["prompt"] for j in jobs] == ["first prompt", "second prompt"]


def test_job_payloads_hold_no_pickle(env):
    res = env.cli("enqueue", "payload check", "--no-chat-template", "--max-new-tokens", "2", "--wait", "--json")
    job_id = json.loads(res.output.splitlines()[-1])["jobs"][0]["job_id"]
    raw = env.r.hgetall(f"rq:job:{job_id}")
    payload = json.loads(zlib.decompress(raw[b"data"]))
    assert payload[0] == "workers.head.jobs.job_function.run_generation" and payload[2][0]["prompt"] == "payload check"
    assert json.loads(raw[b"meta"])["batch"] in job_id
    for key in (f"rq:job:{job_id}", f"{env.prefix}:result:{job_id}"):
        blob = b"".join(env.r.hgetall(key).values()) if key.startswith("rq:") else env.r.get(key)
        assert b"\x80\x04\x95" not in blob and b"\x80\x05\x95" not in blob  # pickle protocol 4/5 frames
    json.loads(env.r.get(f"{env.prefix}:result:{job_id}"))


def test_forged_job_function_is_refused(env, tmp_path):
    marker = tmp_path / "pwned"
    q = Queue(env.queue, connection=env.r, serializer=JSONSerializer)
    job = q.enqueue_call("os.system", args=(f"touch {marker}",), job_id="forged-1")
    for _ in range(100):
        if job.get_status() in ("failed", "finished"):
            break
        time.sleep(0.1)
    assert job.get_status() == "failed" and not marker.exists()
    assert "not allow-listed" in job.latest_result().exc_string
    assert "refused job forged-1" in (env.tmp / "head.log").read_text()


@pytest.mark.slow
def test_rejected_generation_fails_with_reason_then_retry_finishes(
    models, redis_server, redis_client, tmp_path, hf_models, tokenizers
):
    e = Env("reject", models, redis_server, redis_client, tmp_path, tail_extra=["--max-packet-bytes", "600"])
    try:
        prompt = PROMPTS[5]
        res = e.cli(
            "enqueue",
            prompt,
            "--no-chat-template",
            "--max-new-tokens",
            "6",
            "--retries",
            "0",
            "--wait",
            "--timeout",
            "60",
        )
        assert res.exit_code == 1
        batch = e.r.keys(f"{e.prefix}:batch:*")[0].decode().rsplit(":", 1)[-1]
        status = e.cli("status", batch)
        assert "failed" in status.output and "exceeds the cap of 600" in status.output
        e.procs["tail"].kill()
        e.procs["tail"].wait()  # a dying tail's blocked read could still be handed the next packet
        time.sleep(3.5)  # let its consumer entry go stale so only the new tail counts as ready
        e.start_tail()
        res = e.cli("retry", batch, "--wait", "--timeout", "60")
        assert res.exit_code == 0, res.output
        view = e.client.views(e.client.resolve(batch))[0]
        assert view.status == "finished" and view.error is None
        assert view.result["token_ids"] == reference(hf_models["qwen2"], tokenizers["qwen2"], prompt, 6)
    finally:
        e.close()


@pytest.mark.slow
def test_killed_head_worker_job_is_retried_and_finishes(
    models, redis_server, redis_client, tmp_path, hf_models, tokenizers
):
    e = Env("kill", models, redis_server, redis_client, tmp_path)
    try:
        prompt, n = PROMPTS[1], 600
        batch = e.cli("enqueue", prompt, "--no-chat-template", "--max-new-tokens", str(n), "--drafter", "none")
        job_id = e.client.resolve(batch.output.strip())[0]
        deadline = time.monotonic() + 60
        while not e.client.views([job_id])[0].progress and time.monotonic() < deadline:
            time.sleep(0.05)
        e.procs["head"].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        e.procs["head2"] = head_worker(e.ms.target, e.url, e.queue, e.prefix, tmp_path / "head2.log", "kill-h2")
        while e.client.views([job_id])[0].status != "finished" and time.monotonic() < killed_at + 120:
            time.sleep(0.2)
        view = e.client.views([job_id])[0]
        assert view.status == "finished", view
        assert view.result["token_ids"] == reference(hf_models["qwen2"], tokenizers["qwen2"], prompt, n)
        # the retry resumed from the checkpoint: fewer target forwards (rounds) than a fresh run of n
        assert 0 < view.result["resumed_tokens"] < n and view.result["rounds"] == n - view.result["resumed_tokens"]
        assert not e.r.exists(f"{e.prefix}:ckpt:{job_id}")
    finally:
        e.close()


def test_cancel_queued_and_running_then_retry(env):
    """A running job is cancelled through its flag (its head records it canceled); a queued one (here on a
    queue no head serves: a head takes every job it has room for) is cancelled by RQ; both retry."""
    res = env.cli("enqueue", "one", "--no-chat-template", "--max-new-tokens", "1500", "--drafter", "none")
    batch = res.output.strip()
    (running_id,) = env.client.resolve(batch)
    idle = Client(env.r, prefix=env.prefix, queue=f"{env.queue}-unserved")
    (queued_id,) = idle.enqueue([GenerationRequest(prompt="two", max_new_tokens=4)]).job_ids
    deadline = time.monotonic() + 30
    while not env.client.views([running_id])[0].progress and time.monotonic() < deadline:
        time.sleep(0.05)
    assert env.cli("cancel", batch).output.strip() == "cancelled 1 job(s)"
    assert idle.cancel([queued_id]) == [queued_id]
    deadline = time.monotonic() + 30
    while env.client.views([running_id])[0].status != "canceled" and time.monotonic() < deadline:
        time.sleep(0.1)
    running, queued = env.client.views([running_id, queued_id])
    assert (running.status, running.error) == ("canceled", None)
    assert queued.status == "canceled"
    assert env.client.retry([running_id]) == [running_id] and idle.retry([queued_id]) == [queued_id]
    assert env.cli("cancel", batch).exit_code == 0  # leave the worker free for other tests


@pytest.mark.slow
def test_head_worker_with_generations_in_flight(models, redis_server, redis_client, tmp_path, hf_models, tokenizers):
    e = Env("conc", models, redis_server, redis_client, tmp_path, head_extra=("--concurrency", "3"), verbose=True)
    try:
        res = e.cli("enqueue", *PROMPTS[:6], "--no-chat-template", "--max-new-tokens", "12", "--wait", "--json")
        assert res.exit_code == 0, res.output
        jobs = json.loads(res.output.splitlines()[-1])["jobs"]
        for p, job in zip(PROMPTS[:6], jobs, strict=True):
            assert job["result"]["token_ids"] == reference(hf_models["qwen2"], tokenizers["qwen2"], p, 12)
        info = json.loads(e.cli("info", "--json").output)
        assert next(q for q in info["queues"] if q["queue"] == e.queue)["workers"] == 1  # one worker, 3 in flight
        # generations overlapped, never more than --concurrency (RQ's started-to-ended spans may overlap more: a job
        # whose generation ended makes room while its result is stored)
        generating = [int(m) for m in re.findall(r"started \((\d+) generating", (tmp_path / "head.log").read_text())]
        assert len(generating) == 6 and 2 <= max(generating) <= 3, generating
    finally:
        e.close()


def test_a_default_head_refuses_synthetic_drafts(env, tmp_path):
    """The synthetic drafter (benchmarks: drafts from reference ids) lives in bench/synthetic.py and runs only
    on a head started with `--plugin bench.synthetic`; any producer can ask for it, and a production head
    fails the job with the reason (no retry)."""
    line = {"prompt": "Tokyo", "chat_template": False, "max_new_tokens": 4}
    line["draft"] = {"kind": "synthetic", "options": {"reference_ids": [5, 6, 7], "alpha": 1.0}}
    path = tmp_path / "synthetic.jsonl"
    path.write_text(json.dumps(line) + "\n")
    res = env.cli("enqueue", "--file", str(path), "--wait", "--json", "--timeout", "60")
    assert res.exit_code == 1, res.output
    job = json.loads(res.output.splitlines()[-1])["jobs"][0]
    assert job["status"] == "failed" and "drafter kind 'synthetic' is not available" in job["error"], job


@pytest.mark.slow
def test_bench_plugin_sets_acceptance_through_the_job_path(models, redis_server, redis_client, tmp_path):
    """`shardflow head --plugin bench.synthetic` (what bench/jobs.py starts): synthetic requests run through
    the job path with the acceptance they ask for, and the output is the target's own."""
    e = Env("plugin", models, redis_server, redis_client, tmp_path, head_extra=("--plugin", "bench.synthetic"))
    try:
        prompt = {"prompt": PROMPTS[2], "chat_template": False, "max_new_tokens": 24}
        (plain,) = e.client.enqueue([GenerationRequest.model_validate({**prompt, "draft": {"kind": "none"}})]).job_ids
        ref = e.client.wait([plain], timeout=120)[0].result["token_ids"]
        asks = [
            {
                **prompt,
                "draft": {
                    "kind": "synthetic",
                    "k": 4,
                    "adaptive": False,
                    "options": {"alpha": a, "reference_ids": ref},
                },
            }
            for a in (1.0, 0.0)
        ]
        ids = e.client.enqueue([GenerationRequest.model_validate(a) for a in asks]).job_ids
        sure, never = (v.result for v in e.client.wait(ids, timeout=120))
        assert sure["token_ids"] == never["token_ids"] == ref
        assert sure["accepted_tokens"] == sure["drafted_tokens"] > 0 and never["accepted_tokens"] == 0
    finally:
        e.close()


def test_the_allow_list_holds_only_the_job_functions_wire_name():
    """The job function's wire name names its module, and a head allows that name alone."""
    from schemas.jobs import RUN_GENERATION
    from workers.head.jobs.rq_worker import head_job_class

    functions = head_job_class(object()).functions  # type: ignore[arg-type]
    assert RUN_GENERATION == "workers.head.jobs.job_function.run_generation"
    assert list(functions) == [RUN_GENERATION]
