"""The emulated link of the job-path benchmarks (bench/link.py) measured from outside: a plain TCP sink or echo server
in a thread, the proxy as `python -m bench.link --control` in a process of its own (as `spawn_link` runs it; tests
never import bench), and sockets through it. Delivered bandwidth within 10% of the setting, one wire shared by the
connections, the delay's mean within 10% and its jitter's sd near the setting, order kept within a connection, a
stall, the byte counters, and a malformed spec refused. About 8 s on 2 cores.

    pytest -q tests/test_link.py
"""

from __future__ import annotations

import itertools
import json
import select
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Server:
    """A TCP server on loopback, a thread per connection: records when each chunk arrives (per connection, in
    accept order) and, if `echo`, sends it back."""

    echo: bool = False
    arrivals: list[list[tuple[float, bytes]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            got: list[tuple[float, bytes]] = []
            self.arrivals.append(got)
            threading.Thread(target=self._serve, args=(conn, got), daemon=True).start()

    def _serve(self, conn: socket.socket, got: list[tuple[float, bytes]]) -> None:
        with conn:
            while data := conn.recv(1 << 16):
                got.append((time.monotonic(), data))
                if self.echo:
                    conn.sendall(data)

    def received(self, i: int) -> int:
        return sum(len(d) for _, d in self.arrivals[i]) if i < len(self.arrivals) else 0

    def wait_for(self, i: int, n: int, timeout_s: float = 10.0) -> float:
        """When connection i's n-th byte arrived (waits for it)."""
        deadline = time.monotonic() + timeout_s
        while self.received(i) < n:
            assert time.monotonic() < deadline, f"connection {i}: {self.received(i)} of {n} bytes"
            time.sleep(0.002)
        return self.arrivals[i][-1][0]


@dataclass
class Proxy:
    port: int
    ready: str  # the proxy's first line: its address and `Link.describe()`
    proc: subprocess.Popen[str]

    def stats(self) -> dict[str, int]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("stats\n")
        self.proc.stdin.flush()
        assert select.select([self.proc.stdout], [], [], 10)[0], "no answer to stats"
        return json.loads(self.proc.stdout.readline())


@contextmanager
def link(upstream: int, spec: str) -> Iterator[Proxy]:
    """`python -m bench.link --profile SPEC --control` forwarding to 127.0.0.1:UPSTREAM; its stalls count from
    when it prints its first line."""
    cmd = [sys.executable, "-m", "bench.link", "--upstream", f"127.0.0.1:{upstream}", "--profile", spec]
    cmd += ["--port", "0", "--control", "--seed", "1"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and select.select([proc.stdout], [], [], 30)[0], "the proxy did not start"
        line = proc.stdout.readline()
        assert line.startswith("127.0.0.1:"), line
        yield Proxy(int(line.split()[0].rsplit(":", 1)[1]), line, proc)
    finally:
        proc.terminate()
        proc.wait(10)
        for pipe in (proc.stdin, proc.stdout):
            if pipe:
                pipe.close()


def test_delivered_bandwidth_is_the_setting() -> None:
    server = Server()
    with link(server.port, "loopback:mbit=20") as proxy:
        assert "20 Mbit/s each way" in proxy.ready
        n = 2_500_000
        with socket.create_connection(("127.0.0.1", proxy.port)) as c:
            t0 = time.monotonic()
            c.sendall(b"\x01" * n)
            mbit = n * 8 / (server.wait_for(0, n) - t0) / 1e6
        assert abs(mbit - 20) < 2, f"{mbit:.2f} Mbit/s delivered at 20"


def test_connections_share_one_wire() -> None:
    """Two transfers at once through one link: each gets about half of it, together all of it."""
    server = Server()
    n = 1_250_000
    with link(server.port, "loopback:mbit=20") as proxy:
        conns = [socket.create_connection(("127.0.0.1", proxy.port)) for _ in range(2)]
        t0 = time.monotonic()
        senders = [threading.Thread(target=c.sendall, args=(b"\x02" * n,)) for c in conns]
        for s in senders:
            s.start()
        done = [server.wait_for(i, n) - t0 for i in range(2)]
        for s, c in zip(senders, conns, strict=True):
            s.join()
            c.close()
    each = [n * 8 / t / 1e6 for t in done]
    assert all(abs(m - 10) < 1.5 for m in each), f"each {each} Mbit/s; about 10 expected"
    total = 2 * n * 8 / max(done) / 1e6
    assert abs(total - 20) < 2, f"{total:.2f} Mbit/s together at 20"


def test_delay_mean_and_jitter() -> None:
    """One-way delays of small spaced messages (so that order-keeping seldom holds one back): mean within 10% of
    20 ms, sd near 3 ms."""
    server = Server()
    count, spacing_s = 150, 0.01
    sent: list[float] = []
    with link(server.port, "loopback:delay_ms=20,jitter_ms=3") as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port)) as c:
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for i in range(count):
                sent.append(time.monotonic())
                c.sendall(struct.pack("<Q", i) * 2)
                time.sleep(max(0.0, sent[0] + (i + 1) * spacing_s - time.monotonic()))
            server.wait_for(0, count * 16)
    delays, buf = [], b""
    for t, data in server.arrivals[0]:
        buf += data
        while len(buf) >= 16:
            (i,), buf = struct.unpack("<Q", buf[:8]), buf[16:]
            delays.append((t - sent[i]) * 1000)
    assert len(delays) == count
    mean, sd = statistics.fmean(delays), statistics.stdev(delays)
    assert abs(mean - 20) < 2, f"mean delay {mean:.2f} ms at 20"
    assert 2.2 < sd < 4.0, f"jitter sd {sd:.2f} ms at 3"


def test_order_kept_under_jitter_and_bytes_counted() -> None:
    """Jitter larger than the delay, many small writes: the echo comes back byte for byte, and the counters say
    what went each way."""
    server = Server(echo=True)
    payload = b"".join(struct.pack("<I", i) * 16 for i in range(600))  # 64-byte pieces, each its own value
    with link(server.port, "loopback:delay_ms=5,jitter_ms=10") as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port)) as c:
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for i in range(0, len(payload), 64):
                c.sendall(payload[i : i + 64])
                if i % 1280 == 0:
                    time.sleep(0.001)
            back = b""
            c.settimeout(10)
            while len(back) < len(payload):
                back += c.recv(1 << 16)
        assert server.wait_for(0, len(payload)) and b"".join(d for _, d in server.arrivals[0]) == payload
        assert back == payload
        assert proxy.stats() == {"up": len(payload), "down": len(payload), "connections": 1}


def test_stall_delivers_nothing_then_the_backlog() -> None:
    """A 300 ms stall every 0.6 s: messages every 10 ms see one gap of about 300 ms, and those sent during it
    arrive together when it ends."""
    server = Server()
    with link(server.port, "loopback:stall_ms=300,stall_every_s=0.6") as proxy:
        assert "300 ms stalls every 0.6 s" in proxy.ready
        with socket.create_connection(("127.0.0.1", proxy.port)) as c:
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t0 = time.monotonic()
            for i in range(90):  # 0.9 s from about the proxy's start: the first stall, [0.6, 0.9) s, inside
                c.sendall(b"m")
                time.sleep(max(0.0, t0 + (i + 1) * 0.01 - time.monotonic()))
            server.wait_for(0, 90)
    times = [t for t, data in server.arrivals[0] for _ in data]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    longest = max(gaps)
    assert 0.27 < longest < 0.36, f"longest gap {longest * 1000:.0f} ms; a 300 ms stall expected"
    end = times[gaps.index(longest) + 1]
    burst = sum(1 for t in times if end <= t < end + 0.005)
    assert burst >= 20, f"{burst} messages delivered as the stall ended; about 30 were sent during it"
    assert sum(g > 0.1 for g in gaps) == 1


def test_malformed_spec_is_refused() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "bench.link", "--profile", "wan:bandwidth=3"], cwd=REPO, capture_output=True, text=True
    )
    assert out.returncode == 2 and "not FIELD=VALUE" in out.stderr
