"""The security model for real: the shipped ACL file (deploy/users.acl.template, rendered with test
passwords) on a TLS-only redis-server with client certificates made at test time, one user per role.

- every role can do its whole job: a tail and a head worker process and the producer CLI, each logged
  in as its own user over rediss://, run real generations, follow, cancel, retry; ACL LOG stays empty;
- what each role must not do is refused (NOPERM): the producer cannot write to the tails' request
  streams or read verdicts, forge results or command workers; no role runs admin commands;
- TLS: no CA, a foreign CA, no or a foreign client certificate, plain TCP, no password: all refused;
- a forged job record (function or failure callback) never makes a head or a producer import code.

Needs a redis-server 7+ built with TLS (Debian's `redis-server` package; scripts/test.sh installs it
as root); without one these tests skip, which fails the suite under SHARDFLOW_STRICT_TESTS=1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from rq import Queue
from rq.job import Job
from rq.registry import FailedJobRegistry
from rq.serializers import JSONSerializer
from transformers import AutoModelForCausalLM, AutoTokenizer

from producer.cli import main
from producer.local import spawn_tail, wait_for_tails
from relay_broker.connection import connect
from schemas.errors import TransportError
from schemas.jobs import RUN_GENERATION
from schemas.keys import Keys
from tests.secure_redis import (  # its fixtures `pki` and `secured` are registered in tests/conftest.py
    ADMIN_COMMANDS,
    CALLBACK_MARKER,
    N_LAYERS,
    PREFIX,
    QUEUE,
    ROLE_DENIALS,
    ROLE_NEEDS,
    ROLES,
    ROOT,
    SCRIPTING,
    SPLIT,
    Secured,
    _dryrun,
    _refused,
    acl_values,
    render_acl,
)
from workers.tiny_models import build_tokenizer, save_tiny_model


# --- the ACL file and compose.yaml ------------------------------------------------------------------
def test_rendered_acl_holds_only_hashes_and_disables_default():
    pw = acl_values({r: f"{r}-{'x' * 20}" for r in ROLES})
    text = render_acl.render(render_acl.TEMPLATE.read_text(), pw)
    lines = {line.split()[1]: line for line in text.splitlines()}
    assert set(lines) == {"default", *ROLES}
    assert lines["default"].startswith("user default off ") and "nopass" not in text
    for key, value in pw.items():
        assert key.startswith("SHARDFLOW_") or value not in text
    for role in ROLES:
        assert len([t for t in lines[role].split() if t.startswith("#") and len(t) == 65]) == 1
    assert "${" not in text and "shardflow:tail:*" in lines["tail"]
    with pytest.raises(render_acl.RenderError, match="REDIS_HEAD_PASSWORD is not set"):
        unnamed = {k: v for k, v in pw.items() if "HEAD" not in k}
        render_acl.render(render_acl.TEMPLATE.read_text(), unnamed)
    # named heads only: the shared head user is dropped, not an error; a named head's password must be set
    named_only = render_acl.render(
        render_acl.TEMPLATE.read_text(), {k: v for k, v in pw.items() if k != "REDIS_HEAD_PASSWORD"}
    )
    assert "user head " not in named_only and "user head-iso-a " in named_only
    with pytest.raises(render_acl.RenderError, match="REDIS_HEAD_ISO_B_PASSWORD is not set"):
        render_acl.render(render_acl.TEMPLATE.read_text(), {k: v for k, v in pw.items() if "ISO_B" not in k})
    for bad in ("a.b", "a*", "two words", ""):
        if bad:
            with pytest.raises(render_acl.RenderError, match="worker name"):
                render_acl.render(render_acl.TEMPLATE.read_text(), pw | {"SHARDFLOW_ACL_HEADS": bad})
    with pytest.raises(render_acl.RenderError, match="shorter than 16"):
        render_acl.render(render_acl.TEMPLATE.read_text(), pw | {"REDIS_TAIL_PASSWORD": "short"})
    with pytest.raises(render_acl.RenderError, match="SHARDFLOW_REDIS__PREFIX"):
        render_acl.render(render_acl.TEMPLATE.read_text(), pw | {"SHARDFLOW_REDIS__PREFIX": "a*"})


def test_compose_loads_the_rendered_acl_file_and_the_tls_overlay_agrees():
    base = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    tls = yaml.safe_load((ROOT / "deploy" / "compose.tls.yaml").read_text())["services"]
    redis_cmd = base["redis"]["command"]
    assert redis_cmd[redis_cmd.index("--aclfile") + 1] == "/acl/users.acl" and "--user" not in redis_cmd
    assert "render_acl.py" in " ".join(base["acl"]["command"])
    assert base["redis"]["depends_on"]["acl"]["condition"] == "service_completed_successfully"
    tls_cmd = tls["redis"]["command"]
    plain_port = redis_cmd.index("--port")
    assert redis_cmd[plain_port:] == ["--port", "${REDIS_PORT:-6379}"]
    assert tls_cmd[:plain_port] == redis_cmd[:plain_port]  # the overlay only swaps the plain port for TLS
    assert tls_cmd[tls_cmd.index("--port") + 1] == "0" and tls_cmd[tls_cmd.index("--tls-auth-clients") + 1] == "yes"
    for role in ("tail", "head", "producer"):
        pw = f"${{REDIS_{role.upper()}_PASSWORD:-}}"
        assert base[role]["environment"]["SHARDFLOW_REDIS__URL"].startswith(f"redis://{role}:{pw}@")
        url = tls[role]["environment"]["SHARDFLOW_REDIS__URL"]
        assert url.startswith(f"rediss://{role}:{pw}@") and "./tls:/tls:ro" in tls[role]["volumes"]
        assert all(f"{opt}=/tls/" in url for opt in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"))


# --- TLS ---------------------------------------------------------------------------------------------
def test_tls_with_the_ca_and_a_client_certificate_only(secured):
    s, pki, port = secured, secured.pki, secured.server.port
    assert s.client("producer").ping()
    auth = f"producer:{s.passwords['producer']}@127.0.0.1:{port}/0"
    refused = {
        "plain TCP": f"redis://{auth}",
        "no CA (system trust store)": f"rediss://{auth}?ssl_certfile={pki}/client.crt&ssl_keyfile={pki}/client.key",
        "a foreign CA": f"rediss://{auth}?ssl_ca_certs={pki}/rogue-ca.crt"
        f"&ssl_certfile={pki}/client.crt&ssl_keyfile={pki}/client.key",
        "no client certificate": f"rediss://{auth}?ssl_ca_certs={pki}/ca.crt",
        "a foreign client certificate": f"rediss://{auth}?ssl_ca_certs={pki}/ca.crt"
        f"&ssl_certfile={pki}/rogue-client.crt&ssl_keyfile={pki}/rogue-client.key",
    }
    for why, url in refused.items():
        with pytest.raises(TransportError):
            connect(url, attempts=1, socket_connect_timeout=3, socket_timeout=3)
            pytest.fail(f"connected with {why}")
    with pytest.raises(TransportError, match="credentials"):
        connect(s.server.url_for("producer", "wrong-password"), attempts=1)
    with pytest.raises(TransportError, match="credentials"):
        connect(s.server.url_for(None, None), attempts=1)  # the default user is off
    with pytest.raises(TransportError, match="rediss://"):
        connect(f"redis://{auth}?ssl_ca_certs={pki}/ca.crt", attempts=1)


# --- what each role must not do ---------------------------------------------------------------------
@pytest.mark.parametrize("role", ["producer", "head", "tail"])
def test_no_role_runs_admin_commands(secured, role):
    r = secured.client(role)
    for cmd in ADMIN_COMMANDS:
        assert "no permissions" in _refused(r, *cmd), cmd
    assert secured.client("admin").ping()  # still up


@pytest.mark.parametrize("role", ["producer", "head", "tail"])
def test_no_role_runs_lua(secured, role):
    """EVAL "while true do end" 0 and every other way to run a script: refused to each role. Asked of
    ACL DRYRUN first, so that a wrong ACL fails this test instead of freezing the test Redis."""
    r = secured.client(role)
    for cmd in SCRIPTING:
        assert _dryrun(secured, role, *cmd) != "OK", cmd
        assert "no permissions" in _refused(r, *cmd), cmd
    assert secured.client("admin").ping()  # not BUSY


@pytest.mark.parametrize("role", ["producer", "head", "tail"])
def test_each_role_is_kept_out_of_other_roles_keys(secured, role):
    r = secured.client(role)
    for cmd in ROLE_DENIALS[role]:
        assert _dryrun(secured, role, *cmd) != "OK", cmd
        assert "no permissions" in _refused(r, *cmd), cmd


@pytest.mark.parametrize("role", ["producer", "head", "tail", "head-iso-a", "tail-iso-t1"])
def test_each_role_may_run_what_it_needs(secured, role):
    """The other side of the denials: the commands each role's code sends, on the keys it sends them to,
    pass ACL DRYRUN for its user (the real run, test_every_role_does_its_whole_job_under_its_own_user,
    shows nothing else is needed)."""
    for cmd in ROLE_NEEDS[role]:
        assert _dryrun(secured, role, *cmd) == "OK", cmd


# --- everything each role needs, for real ------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("model") / "qwen2", "qwen2", tokenizer=build_tokenizer())


class Workers:
    """A tail and a head worker process, each connected as its own user."""

    def __init__(self, s: Secured, model: Path, logdir: Path) -> None:
        self.logdir, self.procs = logdir, {}
        self.procs["tail"] = spawn_tail(
            model,
            (SPLIT, N_LAYERS),
            s.url("tail"),
            prefix=PREFIX,
            extra=["--threads", "1"],
            log_path=logdir / "tail.log",
        )
        args = ["head", "--target", str(model), "--layers", f"0:{SPLIT}", "--queue", QUEUE, "--prefix", PREFIX]
        args += ["--redis-url", s.url("head"), "--threads", "1", "--name", "sec-h1"]
        args += ["--concurrency", "1"]  # one job at a time: cancel finds one running and one queued
        self.callback_marker = logdir / "head-ran-a-callback"  # what forged_failure_callback would touch
        env = {**os.environ, CALLBACK_MARKER: str(self.callback_marker), "SHARDFLOW_JOBS__MAINTENANCE_S": "1"}
        with (logdir / "head.log").open("ab") as log:
            self.procs["head"] = subprocess.Popen(
                [sys.executable, "-m", "producer", *args], stdout=log, stderr=log, env=env
            )
        admin = s.client("admin")
        wait_for_tails(admin, Keys(PREFIX), proc=self.procs["tail"])
        deadline = time.monotonic() + 90
        while not admin.exists(f"{PREFIX}:model:{QUEUE}") or not admin.scard(f"rq:workers:{QUEUE}"):
            assert self.procs["head"].poll() is None, (logdir / "head.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "head worker did not start"
            time.sleep(0.2)

    def close(self) -> None:
        for p in self.procs.values():
            p.terminate()
        for p in self.procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture(scope="module")
def workers(secured, tiny, tmp_path_factory) -> Iterator[Workers]:
    secured.client("admin").acl_log_reset()
    w = Workers(secured, tiny, tmp_path_factory.mktemp("logs"))
    yield w
    w.close()


def _producer_cli(s: Secured, *args: str):
    return CliRunner().invoke(main, [*args, "--queue", QUEUE, "--prefix", PREFIX, "--redis-url", s.url("producer")])


def _denials(s: Secured) -> list[dict]:
    return [e for e in s.client("admin").acl_log() if e.get("reason") != "auth"]


def _reference(model: Path, prompt: str, n: int) -> list[int]:
    tok = AutoTokenizer.from_pretrained(model)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = torch.tensor([tok.encode(prompt)])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n)
    return out[0, ids.shape[1] :].tolist()


def test_every_role_does_its_whole_job_under_its_own_user(secured, workers, tiny):
    s = secured
    res = _producer_cli(
        s,
        "enqueue",
        "Hello world!",
        "The quick brown fox",
        "--no-chat-template",
        "--max-new-tokens",
        "10",
        "--wait",
        "--json",
        "--timeout",
        "120",
    )
    assert res.exit_code == 0, res.output
    data = json.loads(res.output.splitlines()[-1])
    for prompt, job in zip(("Hello world!", "The quick brown fox"), data["jobs"], strict=True):
        assert job["status"] == "finished"
        assert job["result"]["token_ids"] == _reference(tiny, prompt, 10)
    assert _producer_cli(s, "status", data["batch_id"], "--json").exit_code == 0
    batch = _producer_cli(s, "enqueue", "Once upon a time", "--no-chat-template", "--max-new-tokens", "8")
    follow = _producer_cli(s, "results", batch.output.strip(), "--follow", "--timeout", "60")
    assert follow.exit_code == 0 and follow.output.startswith("[0] "), follow.output
    info = json.loads(_producer_cli(s, "info", "--json").output)
    assert next(q for q in info["queues"] if q["queue"] == QUEUE)["workers"] == 1
    assert info["model"]["head_layers"] == [0, SPLIT]
    _cancel_and_retry(s)
    assert _denials(s) == [], "a role was refused something it needed during a real run"
    # RQ's scheduler (its own process and connection, rebuilt from the head's URL) holds its lock over TLS
    assert s.client("admin").exists(f"rq:scheduler-lock:{QUEUE}")


def test_a_scheduled_job_is_enqueued_by_the_head_scheduler_thread_without_lua(secured, workers, tiny):
    """Retries with a backoff wait in RQ's ScheduledJobRegistry; the head's scheduler (a thread of the head
    process, its lock kept without Lua) enqueues them when due, under the head user, with no ACL denial."""
    s, admin = secured, secured.client("admin")
    lock = admin.get(f"rq:scheduler-lock:{QUEUE}")
    assert lock is not None and int(admin.hget(f"rq:scheduler:{lock.decode()}", "pid")) == workers.procs["head"].pid
    q = Queue(QUEUE, connection=s.client("producer"), serializer=JSONSerializer)
    request = {"prompt": "Hello world!", "max_new_tokens": 4, "chat_template": False}
    job = q.enqueue_in(timedelta(seconds=1), RUN_GENERATION, request, job_id="sec-scheduled-1")
    assert job.get_status() == "scheduled"
    deadline = time.monotonic() + 60
    while job.get_status() not in ("finished", "failed") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert job.get_status() == "finished", job.latest_result()
    assert job.return_value()["token_ids"] == _reference(tiny, "Hello world!", 4)
    assert _denials(s) == []


def _cancel_and_retry(s: Secured) -> None:
    """Cancel a running and a queued job (cancel flag, canceled registry), retry both, cancel again."""
    res = _producer_cli(
        s, "enqueue", "one", "two", "--no-chat-template", "--max-new-tokens", "1500", "--drafter", "none"
    )
    batch = res.output.strip()
    admin = s.client("admin")
    ids = [f"{batch}-{i:05d}" for i in range(2)]
    deadline = time.monotonic() + 60
    while not admin.exists(f"{PREFIX}:tokens:{ids[0]}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _producer_cli(s, "cancel", batch).output.strip() == "cancelled 2 job(s)"
    final = ("failed", "canceled", "finished")
    while time.monotonic() < deadline:
        views = json.loads(_producer_cli(s, "status", batch, "--json").output)["jobs"]
        if all(v["status"] in final for v in views):
            break
        time.sleep(0.2)
    assert [(v["status"], v["error"]) for v in views] == [("canceled", None), ("canceled", None)]
    retried = _producer_cli(s, "retry", batch)
    assert retried.exit_code == 0 and sorted(retried.output.split()[-2:]) == ids, retried.output
    assert _producer_cli(s, "cancel", batch).exit_code == 0
    while time.monotonic() < deadline + 30:
        views = json.loads(_producer_cli(s, "status", batch, "--json").output)["jobs"]
        if all(v["status"] in final for v in views):
            return
        time.sleep(0.2)
    pytest.fail(f"cancelled jobs did not stop: {views}")


def test_a_producer_cannot_make_a_head_run_code(secured, workers, tmp_path):
    marker = tmp_path / "pwned"
    q = Queue(QUEUE, connection=secured.client("producer"), serializer=JSONSerializer)
    job = q.enqueue_call("os.system", args=(f"touch {marker}",), job_id="sec-forged-1")
    deadline = time.monotonic() + 30
    while job.get_status() not in ("failed", "finished") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert job.get_status() == "failed" and not marker.exists()
    assert "not allow-listed" in job.latest_result().exc_string


def forged_failure_callback(*args: object) -> None:
    """Stands in for attacker-chosen code: proves whether a forged failure callback was called."""
    Path(os.environ[CALLBACK_MARKER]).touch()


def test_forged_abandoned_job_never_makes_a_producer_or_a_head_import_code(secured, workers, tmp_path, monkeypatch):
    """RQ's registry cleanup fails abandoned jobs and calls the failure callback a job record names; one
    producer could plant such a record to run code in whichever process runs the cleanup. A producer never
    runs it (`shardflow info` counts registries with ZCARD); the head's maintenance does, and imports
    nothing the record names."""
    marker = tmp_path / "called"
    monkeypatch.setenv(CALLBACK_MARKER, str(marker))
    p = secured.client("producer")
    job = Job.create(
        RUN_GENERATION,
        args=({"prompt": "x"},),
        id="sec-forged-2",
        connection=p,
        serializer=JSONSerializer,
        origin=QUEUE,
    )
    job.save()  # forge it as started and abandoned: not in the queue, in the wip registry, long expired
    callback = f"{__name__}.forged_failure_callback"
    p.hset(job.key, mapping={"status": "started", "failure_callback_name": callback, "retries_left": 0})
    p.zadd(f"rq:wip:{QUEUE}", {f"{job.id}:forged-exec": 1})
    res = _producer_cli(secured, "info", "--json")
    assert res.exit_code == 0, (res.output, repr(res.exception), secured.client("admin").acl_log())
    assert not marker.exists(), "a producer imported and ran a job record's failure callback"
    deadline = time.monotonic() + 30
    while p.hget(job.key, "status") != b"failed" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert p.hget(job.key, "status") == b"failed"  # the head's cleanup ran: abandoned, failed
    assert job.id in FailedJobRegistry(QUEUE, connection=p, serializer=JSONSerializer).get_job_ids(cleanup=False)
    assert not workers.callback_marker.exists(), "a head imported and ran a job record's failure callback"
    assert not marker.exists()
