"""`shardflow redis` and EmbeddedRedis: the server stops with its owner, and a taken port is refused.

SIGINT, SIGTERM and SIGHUP stop `shardflow redis` and its redis-server (the port is free again); a second
`shardflow redis` on a taken port exits 4 with one line and no URL, leaving the first one serving.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time

import pytest
import redis

from relay_broker import embedded
from relay_broker.embedded import EmbeddedRedis, free_port, port_in_use
from schemas.errors import TransportError


def start_cli_redis(port: int) -> tuple[subprocess.Popen, str]:
    """`python -m producer redis --port PORT` and the URL it prints once its server answers."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "producer", "redis", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    url = proc.stdout.readline().strip() if ready else ""
    if not url:
        proc.kill()
        pytest.fail(f"no URL from shardflow redis: {proc.communicate()[1]}")
    return proc, url


def gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def port_freed(port: int, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not port_in_use(port):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_cli_redis_stops_its_server_on_signals(sig):
    port = free_port()
    proc, url = start_cli_redis(port)
    server_pid = int(redis.Redis.from_url(url).info("server")["process_id"])
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert gone(server_pid) and port_freed(port), f"redis-server {server_pid} outlived {sig.name}"


def test_second_cli_redis_on_a_taken_port_fails_and_the_first_keeps_serving():
    port = free_port()
    first, url = start_cli_redis(port)
    try:
        pid = int(redis.Redis.from_url(url).info("server")["process_id"])
        second = subprocess.run(
            [sys.executable, "-m", "producer", "redis", "--port", str(port)], capture_output=True, text=True, timeout=60
        )
        assert second.returncode == 4 and second.stdout == "", second
        assert "Traceback" not in second.stderr and len(second.stderr.strip().splitlines()) == 1, second.stderr
        assert "already in use" in second.stderr
        assert redis.Redis.from_url(url).ping() and int(redis.Redis.from_url(url).info("server")["process_id"]) == pid
    finally:
        first.terminate()
        first.communicate(timeout=20)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_server_dies_with_a_killed_parent():
    port = free_port()
    proc, url = start_cli_redis(port)
    server_pid = int(redis.Redis.from_url(url).info("server")["process_id"])
    proc.kill()  # SIGKILL: no handler runs, only the kernel's parent-death signal stops the server
    proc.communicate(timeout=20)
    assert gone(server_pid) and port_freed(port)


def test_embedded_refuses_a_taken_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(TransportError, match="already in use"):
            EmbeddedRedis(port=s.getsockname()[1]).start()


def test_embedded_never_reports_another_server_as_its_own(redis_server, redis_client, monkeypatch):
    """Even past the port check (a race), a PING answered by another process is not taken for its own,
    and that other server is left running."""
    monkeypatch.setattr(embedded, "port_in_use", lambda port, host="127.0.0.1": False)
    other = EmbeddedRedis(port=redis_server.port)
    with pytest.raises(TransportError, match=r"did not start|exited"):
        other.start()
    assert other.proc is None
    assert redis_client.ping() and redis_server.proc is not None and redis_server.proc.poll() is None


def test_termination_signals_interrupt_like_ctrl_c():
    """`local` and `demo` run under interrupt_on_termination: SIGTERM / SIGHUP unwind them (stopping their
    embedded Redis) as Ctrl-C does; the previous handlers come back afterwards."""
    from producer.local import interrupt_on_termination

    before = signal.getsignal(signal.SIGTERM)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        server = EmbeddedRedis()
        with pytest.raises(KeyboardInterrupt), interrupt_on_termination(), server:
            pid = int(redis.Redis.from_url(server.url).info("server")["process_id"])
            os.kill(os.getpid(), sig)
            time.sleep(5)  # the handler interrupts this
        assert server.proc is None and gone(pid) and port_freed(server.port)
    assert signal.getsignal(signal.SIGTERM) is before


def _cmdlines_with(text: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and text.encode() in open(f"/proc/{entry}/cmdline", "rb").read():
                pids.append(int(entry))
        except OSError:
            pass
    return pids


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_demo_stops_redis_and_workers_on_sigterm(tmp_path):
    from workers.tiny_models import save_tiny_model

    target = save_tiny_model(tmp_path / "tiny", "qwen2")
    proc = subprocess.Popen(
        [sys.executable, "-m", "producer", "demo", "--model-dir", str(target), "--max-new-tokens", "4"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    url, deadline = "", time.monotonic() + 60
    while not url and time.monotonic() < deadline and proc.poll() is None:
        if select.select([proc.stderr], [], [], 1)[0]:
            line = proc.stderr.readline()
            url = next((w.rstrip(";,") for w in line.split() if w.startswith("redis://")), "")
    assert url, "the demo never printed its Redis URL"
    server_pid = int(redis.Redis.from_url(url).info("server")["process_id"])
    workers = _cmdlines_with(url)  # the tail and head processes name the URL on their command lines
    assert len(workers) == 2
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert gone(server_pid) and port_freed(int(url.rsplit(":", 1)[1].split("/")[0]))
    assert all(gone(pid, 20) for pid in workers)
