"""The job system's test bench: a queue served by real tail and head worker processes (`Env`), and greedy
references from Hugging Face `generate`, and OpenAI Batch API input lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from click.testing import CliRunner
from rq import Queue

from producer.cli import main
from producer.client import Client
from producer.local import wait_for_tails
from relay_broker.embedded import free_port
from schemas.keys import Keys
from schemas.openai import TEXT
from tests.zygote import Forked, Zygote, plain_env
from workers.tiny_models import PROMPTS

SPLIT = 2
FORK = os.environ.get("SHARDFLOW_TEST_FORK", "1") != "0"  # 0: every worker process a fresh interpreter
MAX_FORK_SERVERS = 4  # one per environment the workers were started in (tests/zygote.py)
_fork_servers: dict[frozenset, Zygote] = {}


def spawn(args: list[str], log: Path | None, env: dict[str, str] | None = None) -> subprocess.Popen | Forked:
    """Start `python -m MODULE ...` (a worker, serve) with its output appended to `log`: forked from a fork server
    (tests/zygote.py: the heavy imports done once) started in the same environment but for SHARDFLOW_* variables
    (something the session ran may have set a variable since: torch.compile does), else as a fresh process."""
    env = dict(os.environ) if env is None else env
    if FORK and threading.current_thread() is threading.main_thread():  # a server dies with the thread that started it
        key = frozenset(plain_env(env).items())
        if key not in _fork_servers and len(_fork_servers) < MAX_FORK_SERVERS:
            _fork_servers[key] = Zygote(Path(tempfile.mkdtemp(prefix="shardflow-fork-")), env)
        proc = _fork_servers[key].spawn(args, env, log) if key in _fork_servers else None
        if proc is not None:
            return proc
    out = log.open("ab") if log else subprocess.DEVNULL
    return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env)


def stop_fork_servers() -> None:
    """End the fork servers (tests/conftest.py, at the end of the session); a child one still has gets SIGTERM."""
    while _fork_servers:
        _fork_servers.popitem()[1].close()


def tail_args(target: Path, layers: tuple[int, int], url: str, prefix: str, extra: list[str]) -> list[str]:
    """The command line producer.local.spawn_tail runs."""
    where = ["--target", str(target), "--layers", f"{layers[0]}:{layers[1]}", "--redis-url", url, "--prefix", prefix]
    return [sys.executable, "-m", "producer", "tail", *where, *extra]


def head_worker(
    target: Path,
    url: str,
    queue: str,
    prefix: str,
    log: Path,
    name: str,
    extra: tuple[str, ...] = (),
    verbose: bool = False,
) -> subprocess.Popen | Forked:
    env = {
        **os.environ,
        "SHARDFLOW_JOBS__HEARTBEAT_TTL_S": "4",
        "SHARDFLOW_JOBS__HEARTBEAT_S": "1",
        "SHARDFLOW_JOBS__MAINTENANCE_S": "2",
        "SHARDFLOW_RELAY__REPLY_TIMEOUT_S": "3",  # a dead tail is noticed (and its sessions replayed) quickly
        "SHARDFLOW_RELAY__RESUME_ATTEMPTS": "6",
    }
    args = [
        sys.executable,
        "-m",
        "producer",
        *(["-v"] if verbose else []),  # INFO lines in its log
        "head",
        "--target",
        str(target),
        "--layers",
        f"0:{SPLIT}",
        "--queue",
        queue,
        "--prefix",
        prefix,
        "--redis-url",
        url,
        "--threads",
        "1",
        "--name",
        name,
        *extra,
    ]
    return spawn(args, log, env)


def wait_for_worker(r, queue: str, timeout: float = 60) -> None:
    from rq import Worker

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if Worker.count(connection=r, queue=Queue(queue, connection=r)) > 0:
            return
        time.sleep(0.2)
    raise TimeoutError("head worker did not start")


class Env:
    """A queue + prefix served by one tail and one head worker process."""

    def __init__(
        self,
        name: str,
        models,
        redis_server,
        redis_client,
        tmp: Path,
        tail_extra: list[str] | None = None,
        head_extra: tuple[str, ...] = (),
        verbose: bool = False,
    ):
        self.ms, self.url, self.r, self.tmp = models["qwen2"], redis_server.url, redis_client, tmp
        self.queue, self.prefix = f"q-{name}", f"p-{name}"
        self.opts = ["--queue", self.queue, "--prefix", self.prefix, "--redis-url", self.url]
        self.procs: dict[str, subprocess.Popen | Forked] = {}
        self.start_tail(tail_extra)
        self.procs["head"] = head_worker(
            self.ms.target, self.url, self.queue, self.prefix, tmp / "head.log", f"{name}-h1", head_extra, verbose
        )
        wait_for_worker(self.r, self.queue)
        self.client = Client(redis_client, prefix=self.prefix, queue=self.queue)

    def start_tail(self, extra: list[str] | None = None) -> None:
        args = tail_args(
            self.ms.target, (SPLIT, self.ms.n_layers), self.url, self.prefix, ["--threads", "1", *(extra or [])]
        )
        proc = spawn(args, self.tmp / "tail.log")
        wait_for_tails(self.r, Keys(self.prefix), proc=proc)
        self.procs["tail"] = proc

    def cli(self, *args: str, input: str | None = None):
        return CliRunner().invoke(main, [*args, *self.opts], input=input)

    def close(self) -> None:
        for p in self.procs.values():
            p.kill()
            p.wait()


def reference(hf, tok, prompt: str, n: int) -> list[int]:
    ids = torch.tensor([tok.encode(prompt)])
    return hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n)[
        0, ids.shape[1] :
    ].tolist()


def start_serve(
    env: Env, log: Path, key: str, extra_env: dict[str, str] | None = None
) -> tuple[subprocess.Popen | Forked, str]:
    """A `shardflow serve` process for env's queue with one API key (a file of keys), once it answers; (process,
    base URL)."""
    import httpx

    keys = log.with_suffix(".keys")
    keys.write_text(f"# keys of this test\n{key}\n")
    port = free_port()
    args = [sys.executable, "-m", "producer", "serve", "--port", str(port), "--api-keys", str(keys), *env.opts]
    proc = spawn(args, log, {**os.environ, **(extra_env or {})})
    base = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{base}/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
        time.sleep(0.2)


def batch_line(custom_id: str, url: str = TEXT, **body: object) -> dict:
    """One OpenAI Batch API input line (a completion by default, a chat for CHAT), greedy unless body says."""
    body = {"model": "tiny", "temperature": 0, **body}
    if url == TEXT:
        body.setdefault("prompt", PROMPTS[0])
    else:
        body.setdefault("messages", [{"role": "user", "content": PROMPTS[0]}])
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def write_jsonl(path: Path, lines: list[dict]) -> str:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


def upload_batch(client, path: Path, lines: list[dict], endpoint: str = TEXT):
    """A Batch API input file uploaded through `client` (the openai package's) and a batch made of it."""
    with open(write_jsonl(path, lines), "rb") as f:
        upload = client.files.create(file=f, purpose="batch")
    return client.batches.create(input_file_id=upload.id, endpoint=endpoint, completion_window="24h")


def wait_batch(client, batch, status: str, timeout_s: float):
    """The batch, polled until it reaches `status` (an assertion past timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while batch.status != status:
        assert time.monotonic() < deadline, batch
        time.sleep(0.3)
        batch = client.batches.retrieve(batch.id)
    return batch
