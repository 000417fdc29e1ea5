"""`shardflow serve` from outside, with no head worker process at all (one serve process on a queue of its own,
the session's Redis): with no live head a request is a 503 within seconds naming why and /v1/models lists
nothing; a head's announced model is listed by a stable name once a heartbeat is fresh, and an unknown model
is a 404 `model_not_found` (a Batch line naming one is a 400, and so is every line while no model is known); a
head that stops beating fails the request waiting on it; bodies nested 20k-100k levels deep are 400s (chat,
completions, batches, a Batch input line); strict types and plain words; clients that trickle their bodies
never hold the concurrency slots and get 408; one key's batches and files are 404 to another, an admin key
sees them and CLI batches, which plain keys never reach. Heartbeats are written as a head's RQ worker record
would be (producer/liveness.py reads them)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from types import SimpleNamespace

import httpx
import openai
import pytest
from rq.worker_registration import WORKERS_BY_QUEUE_KEY

from producer.client import Client
from schemas.jobs import ModelInfo
from schemas.keys import Keys
from schemas.openai import CHAT, TEXT
from schemas.requests import GenerationRequest
from tests.job_env import batch_line, start_serve, write_jsonl

KEY, OTHER, ADMIN = "key-a", "key-b", "key-admin"
QUEUE, PREFIX = "q-hard", "p-hard"
MODEL = "qwen2-tiny"  # the stable name of the announced target below (its directory's name, not the path)
LIMITS = {
    "SHARDFLOW_API_KEYS": OTHER,
    "SHARDFLOW_API_ADMIN_KEYS": ADMIN,
    "SHARDFLOW_API__MAX_CONCURRENT": "2",
    "SHARDFLOW_API__BODY_TIMEOUT_S": "2",
    "SHARDFLOW_API__LIVENESS_S": "0.2",
    "SHARDFLOW_JOBS__HEARTBEAT_TTL_S": "2",
}


@pytest.fixture(scope="module")
def bare(redis_server, redis_client, tmp_path_factory):
    """A serve process over a queue no head serves."""
    tmp = tmp_path_factory.mktemp("api-hard")
    env = SimpleNamespace(opts=["--queue", QUEUE, "--prefix", PREFIX, "--redis-url", redis_server.url])
    log = tmp / "serve.log"
    proc, base = start_serve(env, log, KEY, LIMITS)  # type: ignore[arg-type]
    port = int(base.rsplit(":", 1)[1].split("/")[0])
    yield SimpleNamespace(
        r=redis_client, base=base, port=port, log=log, tmp=tmp, url=redis_server.url, client=as_key(base, KEY)
    )
    proc.terminate()
    assert proc.wait(20) == 0  # SIGTERM: a clean exit


def as_key(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=20)


def announce(r, target: str = f"/tmp/somewhere/private/{MODEL}") -> None:
    info = ModelInfo(target=target, vocab_size=320, has_chat_template=True, head_layers=[0, 2])
    r.set(Keys(PREFIX).model_info(QUEUE), info.model_dump_json())


class FakeHead:
    """A head's RQ worker record, beating every 0.3 s while `beating`."""

    def __init__(self, r, name: str) -> None:
        self.r, self.key, self.beating = r, f"rq:worker:{name}", threading.Event()
        r.sadd(WORKERS_BY_QUEUE_KEY % QUEUE, self.key)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.done = False
        self.thread.start()

    def beat(self, ago_s: float = 0.0) -> None:
        stamp = datetime.fromtimestamp(time.time() - ago_s, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        self.r.hset(self.key, mapping={"last_heartbeat": stamp, "queues": QUEUE, "state": "idle"})

    def _run(self) -> None:
        while not self.done:
            if self.beating.is_set():
                self.beat()
            time.sleep(0.3)

    def close(self) -> None:
        self.done = True
        self.thread.join(5)
        self.r.delete(self.key)
        self.r.srem(WORKERS_BY_QUEUE_KEY % QUEUE, self.key)


def models(bare) -> list[str]:
    return [m.id for m in bare.client.models.list()]


def until(check, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while not (got := check()):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    return got


def test_no_live_head_is_a_fast_503_and_no_model(bare):
    bare.r.delete(Keys(PREFIX).model_info(QUEUE))
    assert models(bare) == []
    for call in (
        lambda: bare.client.completions.create(model=MODEL, prompt="x", max_tokens=2),
        lambda: bare.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}]),
        lambda: list(bare.client.completions.create(model=MODEL, prompt="x", stream=True)),
    ):
        with pytest.raises(openai.InternalServerError, match="no head worker is running") as e:
            call()  # the client's 20 s timeout: an answer within seconds, not after api.timeout_s
        assert e.value.status_code == 503
    announce(bare.r)  # what a head that died leaves: its announcement, no live record
    head = FakeHead(bare.r, "dead-head")
    try:
        head.beat(ago_s=60)
        time.sleep(0.5)  # past the server's last look (SHARDFLOW_API__LIVENESS_S)
        assert models(bare) == []
        with pytest.raises(openai.InternalServerError, match="no head worker is alive"):
            bare.client.completions.create(model=MODEL, prompt="x", max_tokens=2)
        with pytest.raises(openai.NotFoundError) as nf:
            bare.client.completions.create(model="gpt-nonexistent", prompt="x", max_tokens=2)
        assert nf.value.body["code"] == "model_not_found"
    finally:
        head.close()


def test_a_live_head_lists_its_model_by_a_stable_name_and_its_death_fails_the_request(bare):
    announce(bare.r)
    head = FakeHead(bare.r, "live-head")
    head.beating.set()
    try:
        assert until(lambda: models(bare)) == [MODEL]  # the directory's name, never the local path
        assert bare.client.models.retrieve(MODEL).id == MODEL
        with pytest.raises(openai.NotFoundError) as nf:
            bare.client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
        assert nf.value.body["code"] == "model_not_found" and "/tmp" not in str(nf.value.body)
        got: dict = {}

        def waiting() -> None:  # a request the (fake) head never runs: it waits, then its head stops beating
            try:
                bare.client.completions.create(model=MODEL, prompt="x", max_tokens=2)
            except openai.APIStatusError as e:
                got["error"] = e

        t = threading.Thread(target=waiting)
        t.start()
        time.sleep(1.0)
        assert t.is_alive()  # still waiting for its job
        head.beating.clear()
        t.join(20)
        assert not t.is_alive() and got["error"].status_code == 503 and "no head worker" in str(got["error"])
        assert until(lambda: models(bare) == [])
        jobs = Client(bare.r, prefix=PREFIX, queue=QUEUE)
        queued = [j for j in jobs.queue.get_job_ids()]
        assert queued == []  # its job was cancelled, not left queued for a head that may come back
    finally:
        head.close()


DEEP = [20_000, 100_000]


@pytest.mark.parametrize("levels", DEEP)
def test_deeply_nested_json_is_a_400(bare, levels):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    bodies = [
        b"[" * levels + b"]" * levels,
        b'{"model": "m", "prompt": ' + b"[" * levels + b"]" * levels + b"}",
        b'{"a":' * levels + b"1" + b"}" * levels,
    ]
    for path in ("/chat/completions", "/completions", "/batches"):
        for body in bodies:
            r = httpx.post(bare.base + path, content=body, headers=headers, timeout=20)
            assert r.status_code == 400, (path, r.text)
            assert "deeper than 64 levels" in r.json()["error"]["message"]
    line = b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": ' + b"[" * levels + b"]" * levels
    upload = bare.client.files.create(file=("in.jsonl", line + b"}\n"), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="line 1: invalid JSON: nested too deeply"):
        bare.client.batches.create(input_file_id=upload.id, endpoint=TEXT, completion_window="24h")
    r = httpx.post(bare.base + "/completions", content=b"[" * 100 + b"]" * 100, headers=headers)
    assert r.status_code == 400 and "deeper than 64" in r.text


@pytest.mark.parametrize(
    "body, words",
    [
        ({"model": MODEL, "prompt": "x", "max_tokens": True}, "max_tokens: must be an integer"),
        ({"model": MODEL, "prompt": "x", "max_tokens": "8"}, "max_tokens: must be an integer"),
        ({"model": MODEL, "prompt": "x", "stream": "yes"}, "stream: must be true or false"),
        ({"model": MODEL, "prompt": 5}, "prompt: must be a string or a list"),
        ({"model": MODEL, "prompt": "x", "temperature": "1"}, "temperature: must be a number"),
    ],
)
def test_types_are_strict_and_said_in_plain_words(bare, body, words):
    r = httpx.post(bare.base + "/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["message"] == words


def test_a_long_message_is_a_plain_400(bare):
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * ((1 << 20) + 1)}]}
    r = httpx.post(bare.base + "/chat/completions", json=big, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and message == "messages[0].content: over the limit of 1048576 characters"


def trickle(port: int, path: str = "/v1/completions") -> socket.socket:
    """A client that sends its headers and the first byte of a 1000-byte body, then nothing more."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
    s.sendall((head + "Content-Length: 1000\r\n\r\n{").encode())
    return s


def test_slow_bodies_never_hold_the_concurrency_slots(bare):
    """Twice as many tricklers as the limit (2): other requests are served, not 429; each trickler gets 408
    once the body deadline (2 s) passes; clients that vanish mid-body leave no traceback in the log."""
    slow = [trickle(bare.port) for _ in range(4)]
    time.sleep(0.5)
    assert bare.client.models.list().data is not None  # a GET: served
    with pytest.raises(openai.InternalServerError, match="no head worker"):  # a POST: past its body, to the queue
        bare.client.completions.create(model=MODEL, prompt="x", max_tokens=1)
    for s in slow:
        assert s.recv(4096).startswith(b"HTTP/1.1 408"), "a trickler's answer"
        s.close()
    for _ in range(3):  # gone mid-body
        s = trickle(bare.port)
        time.sleep(0.2)
        s.close()
    time.sleep(0.5)
    text = bare.log.read_text()
    assert "Traceback" not in text and "unexpected error" not in text


def test_one_keys_batches_and_files_are_invisible_to_another(bare, tmp_path):
    announce(bare.r)
    mine, other, admin = bare.client, as_key(bare.base, OTHER), as_key(bare.base, ADMIN)
    path = tmp_path / "in.jsonl"
    with open(write_jsonl(path, [batch_line("a", model=MODEL, max_tokens=2)]), "rb") as f:
        upload = mine.files.create(file=f, purpose="batch")
    batch = mine.batches.create(input_file_id=upload.id, endpoint=TEXT, completion_window="24h")
    for call in (
        lambda: other.batches.retrieve(batch.id),
        lambda: other.batches.cancel(batch.id),
        lambda: other.files.content(upload.id),
        lambda: other.files.retrieve(upload.id),
        lambda: other.files.content(f"file-out-{batch.id}"),
        lambda: other.batches.create(input_file_id=upload.id, endpoint=TEXT, completion_window="24h"),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert batch.id not in [b.id for b in other.batches.list()]
    assert batch.id in [b.id for b in mine.batches.list()] and batch.id in [b.id for b in admin.batches.list()]
    assert admin.batches.retrieve(batch.id).id == batch.id and admin.files.content(upload.id).text
    cli = Client(bare.r, prefix=PREFIX, queue=QUEUE).enqueue([GenerationRequest(prompt="x")])  # not via the API
    with pytest.raises(openai.NotFoundError):
        mine.batches.retrieve(cli.batch_id)
    with pytest.raises(openai.NotFoundError):
        mine.files.content(f"file-err-{cli.batch_id}")
    assert admin.batches.retrieve(cli.batch_id).request_counts.total == 1
    assert mine.batches.cancel(batch.id).status in ("cancelling", "cancelled")  # its own: cancelled


def test_batch_lines_name_the_model_served(bare, tmp_path):
    """Announced just now, within the server's cached look at the queue (SHARDFLOW_API__LIVENESS_S): the batch's
    check reads the announcement afresh."""
    announce(bare.r)
    with open(write_jsonl(tmp_path / "in.jsonl", [batch_line("a", CHAT, model="gpt-4o")]), "rb") as f:
        upload = bare.client.files.create(file=f, purpose="batch")
    with pytest.raises(openai.BadRequestError, match="line 1: the model 'gpt-4o' is not served here"):
        bare.client.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h")


def test_batch_lines_are_refused_while_no_model_is_known(bare, tmp_path):
    """Nothing announced and no --served-model-name: no line's model can be checked, so every line is refused
    (never left to run on whatever model a head brings later); once a head announces, only the wrong one is."""
    bare.r.delete(Keys(PREFIX).model_info(QUEUE))
    lines = [batch_line("a", CHAT, model="gpt-4o"), batch_line("b", CHAT, model=MODEL)]
    with open(write_jsonl(tmp_path / "in.jsonl", lines), "rb") as f:
        upload = bare.client.files.create(file=f, purpose="batch")

    def create():
        return bare.client.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h")

    with pytest.raises(openai.BadRequestError) as unknown:
        create()
    assert unknown.value.body["code"] == "model_not_found"
    assert unknown.value.body["message"] == (
        f"line 1: the model 'gpt-4o' cannot be checked; line 2: the model '{MODEL}' cannot be checked "
        "(no head worker has announced its model yet: start one, or serve with --served-model-name)"
    )
    announce(bare.r)
    with pytest.raises(openai.BadRequestError) as wrong:
        create()
    assert wrong.value.body["message"] == "line 1: the model 'gpt-4o' is not served here (GET /v1/models lists what is)"


def serve_args(url: str, port: int) -> list[str]:
    return [sys.executable, "-m", "producer", "serve", "--no-auth", "--port", str(port), "--redis-url", url]


def test_a_taken_port_is_one_line_and_no_url(bare):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        res = subprocess.run(serve_args(bare.url, taken.getsockname()[1]), capture_output=True, text=True, timeout=60)
    out = (res.stdout + res.stderr).strip().splitlines()
    assert res.returncode == 4 and len(out) == 1 and "cannot listen on" in out[0] and "http://" not in out[0]


def test_the_url_comes_once_bound_and_sigterm_exits_0(bare):
    proc = subprocess.Popen(serve_args(bare.url, 0), stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()  # port 0: the URL names the port actually bound
        base = line.strip().rsplit(" ", 1)[-1]
        assert base.startswith("http://127.0.0.1:") and not base.endswith(":0/v1"), line
        assert httpx.get(f"{base}/models", timeout=10).status_code == 200
        proc.terminate()
        assert proc.wait(20) == 0
    finally:
        proc.kill()
