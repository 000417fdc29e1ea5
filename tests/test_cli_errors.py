"""Bad input to every `shardflow` verb: the documented exit code and one error line, never a traceback.

Exit codes (producer/cli.py): 2 bad usage or invalid input, 3 unknown batch or job, 4 Redis unreachable or
refusing (bad URL, credentials, no permission, DB index out of range, port taken). Most cases run in process
through click's CliRunner (cheap); those where the real process matters (stdin bytes, the traceback Python
itself would print, `shardflow redis`) run as `python -m producer`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from producer.cli import main
from relay_broker.embedded import EmbeddedRedis, free_port

QUEUE, PREFIX = f"errq-{os.getpid()}", f"errp-{os.getpid()}"
OK_USER, OK_PW, NOPERM_USER, NOPERM_PW = "default", "adminpw", "nobody", "pw"


@pytest.fixture(scope="module")
def acl_server(tmp_path_factory) -> Iterator[EmbeddedRedis]:
    """A Redis whose default user needs a password and whose `nobody` may only connect (PING, AUTH)."""
    acl = tmp_path_factory.mktemp("acl") / "users.acl"
    acl.write_text(f"user {OK_USER} on >{OK_PW} ~* &* +@all\nuser {NOPERM_USER} on >{NOPERM_PW} -@all +@connection\n")
    with EmbeddedRedis(aclfile=acl, username=OK_USER, password=OK_PW) as server:
        yield server


@pytest.fixture(scope="module")
def urls(redis_server, acl_server) -> dict[str, str]:
    base = redis_server.url.rsplit("/", 1)[0]
    return {
        "ok": redis_server.url,
        "closed": f"redis://127.0.0.1:{free_port()}/0",
        "scheme": f"http://127.0.0.1:{redis_server.port}/0",
        "db": f"{base}/99",
        "wrongpw": acl_server.url_for(OK_USER, "wrong"),
        "noperm": acl_server.url_for(NOPERM_USER, NOPERM_PW),
    }


def check(code: int, stdout: str, stderr: str, want: int, usage: bool) -> None:
    """The documented code; no traceback; exactly one error line (ours is all of stderr; click's usage
    errors keep their `Usage:` / `Try ... --help` hint lines around their one `Error:` line)."""
    assert code == want, (code, stdout, stderr)
    assert "Traceback" not in stderr + stdout, stderr
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith(("error:", "Error:"))]
    assert len(errors) == 1, stderr
    if not usage:
        assert lines == errors, stderr


def invoke(args: list[str], want: int, usage: bool = False, stdin: bytes | None = None) -> None:
    res = CliRunner().invoke(main, args, input=stdin)
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception
    check(res.exit_code, res.stdout, res.stderr, want, usage)


def run(args: list[str], want: int, usage: bool = False, stdin: bytes | None = None) -> str:
    res = subprocess.run(
        [sys.executable, "-m", "producer", *args], input=stdin, capture_output=True, timeout=60, check=False
    )
    stdout, stderr = res.stdout.decode(errors="replace"), res.stderr.decode(errors="replace")
    check(res.returncode, stdout, stderr, want, usage)
    return stdout


def jobs(url: str) -> list[str]:
    return ["--redis-url", url, "--queue", QUEUE, "--prefix", PREFIX]


def test_enqueue_bad_input(urls, tmp_path, redis_client):
    binary, latin1 = tmp_path / "binary.bin", tmp_path / "latin1.txt"
    binary.write_bytes(bytes(range(256)) * 4)
    latin1.write_bytes("café au lait\nnaïve\n".encode("latin-1"))
    ok = jobs(urls["ok"])
    # real processes: Python's own stdin decoding and traceback printing are in play
    run(["enqueue", "--file", str(binary), *ok], 2)
    run(["enqueue", "-", *ok], 2, stdin=b"\xff\xfe caf\xe9\n")
    invoke(["enqueue", "--file", str(latin1), *ok], 2)
    invoke(["enqueue", "-", *ok], 2, stdin="café\n".encode("latin-1"))
    invoke(["enqueue", "--file", str(tmp_path / "missing.txt"), *ok], 2)
    invoke(["enqueue", "--file", str(tmp_path), *ok], 2)
    invoke(["enqueue", *ok], 2)  # no prompts
    invoke(["enqueue", "", *ok], 2)  # an empty prompt
    invoke(["enqueue", "hi", "--stop", "", *ok], 2)
    for bad in (
        ["--batch-id", "a b"],
        ["--batch-id", "*"],
        ["--batch-id", "a.b"],
        ["--batch-id", "x" * 65],
        ["--retries", "-1"],
        ["--timeout", "-1"],
        ["--timeout", "0"],
        ["--result-ttl", "0"],
        ["--result-ttl", "-5"],
        ["--max-new-tokens", "0"],
        ["--temperature", "-1"],
        ["--top-p", "0"],
        ["--top-k", "-1"],
        ["--seed", "-1"],
        ["-k", "-1"],
        ["--drafter", "magic"],
    ):
        invoke(["enqueue", "hi", *bad, *ok], 2, usage=True)
    assert not redis_client.keys(f"{PREFIX}:*") and not redis_client.keys(f"rq:*{QUEUE}*")  # nothing enqueued


def test_enqueue_bad_redis(urls):
    run(["enqueue", "hi", *jobs(urls["db"])], 4)
    run(["enqueue", "hi", *jobs(urls["noperm"])], 4)  # NoPermissionError
    for url in ("closed", "scheme", "wrongpw"):
        invoke(["enqueue", "hi", *jobs(urls[url])], 4)


@pytest.mark.parametrize("verb", ["status", "results", "retry", "cancel"])
def test_job_verbs_bad_input(verb, urls):
    invoke([verb, "no-such-batch", *jobs(urls["ok"])], 3)
    for url in ("closed", "scheme", "db", "wrongpw", "noperm"):
        invoke([verb, "some-batch", *jobs(urls[url])], 4)
    if verb in ("results", "retry"):
        invoke([verb, "some-batch", "--wait", "--timeout", "-1", *jobs(urls["ok"])], 2, usage=True)


def test_info_dead_letters_retry_failed_bad_input(urls):
    invoke(["retry", *jobs(urls["ok"])], 2)  # neither a target nor --failed
    relay = ["--prefix", PREFIX]  # dead-letters reads no queue
    invoke(["dead-letters", "--count", "0", "--redis-url", urls["ok"], *relay], 2, usage=True)
    for url in ("closed", "scheme", "db", "wrongpw", "noperm"):
        for verb in (["info"], ["status"], ["retry", "--failed"]):
            invoke([*verb, *jobs(urls[url])], 4)
        invoke(["dead-letters", "--redis-url", urls[url], *relay], 4)


def test_redis_bad_input(redis_server):
    for port in ("-1", "65536", "x"):
        invoke(["redis", "--port", port], 2, usage=True)
    assert run(["redis", "--port", str(redis_server.port)], 4) == ""  # taken: no URL printed
    assert redis_server.proc is not None and redis_server.proc.poll() is None


def test_worker_verbs_bad_input(tmp_path):
    """Bad input to tail, head, generate, local and demo fails before (or instead of) loading a model."""
    empty = tmp_path / "empty"
    empty.mkdir()
    missing = str(tmp_path / "missing")
    for bad in (
        ["tail", "--target", "x", "--layers", "1:2", "--max-sessions", "0"],
        ["tail", "--target", "x", "--layers", "1:2", "--session-ttl", "-1"],
        ["tail", "--target", "x", "--layers", "1:2", "--threads", "0"],
        ["tail", "--target", "x", "--layers", "1:2", "--slots", "0"],
        ["head", "--target", "x", "--layers", "0:2", "--concurrency", "0"],
        ["head", "--target", "x", "--layers", "1:2"],
        ["generate", "hi", "--target", "x", "--layers", "0:2", "--max-new-tokens", "0"],
        ["generate", "hi", "--target", "x", "--layers", "2:4"],
        ["local", "hi", "--split", "0"],
        ["local", "hi", "--max-new-tokens", "-3"],
        ["demo", "--max-new-tokens", "0"],
        ["demo", "--model-dir", missing],
    ):
        invoke(bad, 2, usage=True)
    invoke(["generate", "hi", "--target", "x", "--layers", "0:2", "--stop", ""], 2)  # request check: one line
    for verb in (["tail", "--layers", "1:2"], ["head", "--layers", "0:1"], ["generate", "hi", "--layers", "0:1"]):
        invoke([*verb, "--target", missing], 2)  # no such model
    invoke(["local", "hi", "--target", missing], 2)
    invoke(["demo", "--model-dir", str(empty)], 2)  # no config.json


def test_verbose_shows_redis_tracebacks(urls):
    """-v keeps a Redis error's traceback visible (logged), still ending in the one-line error."""
    res = subprocess.run(
        [sys.executable, "-m", "producer", "-v", "info", *jobs(urls["noperm"])], capture_output=True, text=True
    )
    assert res.returncode == 4 and "NoPermissionError" in res.stderr, res.stderr
    assert res.stderr.rstrip().splitlines()[-1].startswith("error: Redis refused")


def test_local_split_beyond_the_model(tmp_path):
    from workers.tiny_models import save_tiny_model

    target = save_tiny_model(Path(tmp_path) / "tiny", "qwen2")
    invoke(["local", "hi", "--target", str(target), "--split", "99"], 2)
