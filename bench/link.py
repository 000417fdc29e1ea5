"""An emulated network link between a worker and Redis: a userspace TCP proxy on loopback (the kernel here has no
netem) with, per direction, one shared wire of a given bandwidth, a propagation delay with jitter, and stalls.

    python -m bench.link --upstream 127.0.0.1:6379 --profile notebooks --port 6380 [--mbit 100] [--jitter-ms 5]
    with LinkProxy("127.0.0.1", 6379, PROFILES["wan"]) as proxy: connect(f"redis://127.0.0.1:{proxy.port}/0")
    with spawn_link(6379, parse_link("notebooks")) as link: ... link.port, link.counters()  # a process of its own

The model, per direction (client -> upstream is "up", upstream -> client "down"), shared by every connection through
one proxy (one worker's link):
- the wire: a chunk of n bytes read from a socket (at most 64 KiB, so a big transfer is spread out) goes on the wire
  when the bytes before it in that direction, from any connection, have left it: it leaves at
  max(now, wire free) + 8 n / bandwidth, and the wire is free from then;
- the propagation: it is delivered `delay_ms` later, plus a normal draw of sd `jitter_ms` (the sum clipped at 0),
  but never before the previous chunk of the same connection (order is kept within a connection);
- stalls: `stall_ms` every `stall_every_s` seconds from the proxy's start, the wire neither sends nor delivers (a
  chunk due in a stall is delivered when it ends; one that would go on the wire waits for its end);
- a connection stops reading while its last chunk is more than 20 ms from leaving the wire (the bottleneck's queue
  holds about 20 ms of each busy connection, the rest waits in its sender's socket buffer, as behind a TCP window):
  connections that send at once share the wire about evenly, chunk by chunk, instead of the first one's whole
  transfer going first; and at most 64 MiB read and not yet delivered (a memory guard for links with no cap).
The event loop's timer wakes about 1 ms late at worst, so delays are good to about 1 ms (a chunk due within 0.5 ms
goes at once: `lan` measures about 0.15 ms a round trip, the proxy's own hops, not 0.5; `wan` 87.4 ms); bandwidth is
exact over a transfer, since due times are absolute.

Profiles (`PROFILES`; delay, jitter and bandwidth each way; a round trip is twice the delay):

| name | delay | jitter sd | Mbit/s | stalls |
|---|---|---|---|---|
| `loopback` | 0 | 0 | no cap | — |
| `lan` | 0.25 ms | 0 | 1,000 | — |
| `wan` | 43 ms | 0 | no cap | — |
| `notebooks` | 43 ms | 7 ms | 200 | — |
| `notebooks-stalls` | 43 ms | 7 ms | 200 | 500 ms every 10 s |
| `small-relay` | 43 ms | 0 | 50 | — |

Their sources:
- `loopback`: the proxy alone, nothing added: what the proxy costs by itself;
- `lan`: a switched gigabit LAN, 0.5 ms round trip;
- `wan`: the 86 ms round trip between two free notebooks that the reference system measured, with no cap: the link of
  the figures in docs/benchmarks.md before issue 58 (bench.jobs `--delay-ms 43`), and bench.jobs' default;
- `notebooks` (issue 58): the same 86 ms, ±10 ms a round trip (sd √2 × 7 ms), capped at 200 Mbit/s each way, near
  the 210 Mbit/s that Shard measured delivered on a box sold as 1,316 Mbit/s;
- `notebooks-stalls` (issue 58, item 6): `notebooks` with whole-link stalls, for Shard's round times swinging from
  171 to 340 ms on one ring;
- `small-relay` (issue 58): a small burstable VM as the Redis relay, as the reference system used, at its low
  baseline (50 Mbit/s) rather than its burst.

A link spec (`parse_link`, `--link` of bench.jobs, `--profile` here) is a profile name, optionally followed by
overrides of its fields: `notebooks`, `wan:mbit=100,jitter_ms=5`, `notebooks:stall_ms=500,stall_every_s=5`
(fields: delay_ms, jitter_ms, mbit, stall_ms, stall_every_s; `mbit=0` or `mbit=none`: no cap). `none` is no link at
all (a direct connection; `parse_link` returns None). `Link.spec()` writes one back.

`--control` (what `spawn_link` uses): stdin takes commands, `stats` printing the byte counters as a JSON line
({"up": bytes delivered upstream, "down": ..., "connections": ...}); the proxy exits at the end of stdin. Without
it, the proxy runs until Ctrl-C, then prints them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import random
import select
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import click

CHUNK = 1 << 16  # bytes read from a socket at a time: one chunk on the wire
QUEUE_S = 0.02  # a connection stops reading while its last chunk is further than this from leaving the wire
MAX_PENDING = 64 << 20  # bytes a connection holds each way, read and not yet delivered, before it stops reading
EARLY_S = 0.0005  # a chunk due within this is delivered at once (the event loop's timer is good to about 1 ms)


@dataclass(frozen=True)
class Link:
    """One link, each way alike: delay and jitter (sd of a normal draw per chunk) in ms, bandwidth in Mbit/s
    (None: no cap), `stall_ms` with nothing sent or delivered every `stall_every_s` seconds (0: none)."""

    name: str
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    mbit: float | None = None
    stall_ms: float = 0.0
    stall_every_s: float = 0.0

    def __post_init__(self) -> None:
        times = (self.delay_ms, self.jitter_ms, self.stall_ms, self.stall_every_s)
        if not all(math.isfinite(t) and t >= 0 for t in times):
            raise ValueError(f"{self.name}: delays, jitter and stalls are finite and >= 0")
        if self.mbit is not None and not (math.isfinite(self.mbit) and self.mbit > 0):
            raise ValueError(f"{self.name}: mbit is > 0 (None: no cap)")
        if (self.stall_ms > 0) != (self.stall_every_s > 0) or self.stall_ms >= self.stall_every_s * 1000 > 0:
            raise ValueError(f"{self.name}: a stall needs both stall_ms and stall_every_s, stall_ms shorter")

    def spec(self) -> str:
        """The spec `parse_link` reads back: the profile's name and the fields that differ from it (a link not
        named after a profile: `loopback` and its fields)."""
        base = PROFILES.get(self.name, PROFILES["loopback"])
        diffs = [f"{f}={_show(getattr(self, f))}" for f in FIELDS if getattr(self, f) != getattr(base, f)]
        return base.name + (":" + ",".join(diffs) if diffs else "")

    def overridden(self, changes: Mapping[str, float | None]) -> Link:
        """This link with the fields in `changes` (names of FIELDS) changed; `mbit` None: no cap."""

        def num(field: str) -> float:
            value = changes.get(field)
            return float(getattr(self, field)) if value is None else value

        mbit = changes["mbit"] if "mbit" in changes else self.mbit
        return Link(self.name, num("delay_ms"), num("jitter_ms"), mbit, num("stall_ms"), num("stall_every_s"))

    def describe(self) -> str:
        """One line: `notebooks: 43 ms ± 7 ms each way, 200 Mbit/s each way, no stalls`."""
        cap = f"{_show(self.mbit)} Mbit/s each way" if self.mbit else "no bandwidth cap"
        stalls = (
            f"{_show(self.stall_ms)} ms stalls every {_show(self.stall_every_s)} s" if self.stall_ms else "no stalls"
        )
        return f"{self.spec()}: {_show(self.delay_ms)} ms ± {_show(self.jitter_ms)} ms each way, {cap}, {stalls}"


def _show(x: float | None) -> str:
    return "none" if x is None else f"{x:g}"


FIELDS = ("delay_ms", "jitter_ms", "mbit", "stall_ms", "stall_every_s")

PROFILES: dict[str, Link] = {
    link.name: link
    for link in (
        Link("loopback"),
        Link("lan", delay_ms=0.25, mbit=1000),
        Link("wan", delay_ms=43),
        Link("notebooks", delay_ms=43, jitter_ms=7, mbit=200),
        Link("notebooks-stalls", delay_ms=43, jitter_ms=7, mbit=200, stall_ms=500, stall_every_s=10),
        Link("small-relay", delay_ms=43, mbit=50),
    )
}


def parse_link(spec: str) -> Link | None:
    """`NAME[:field=value,...]` (see the module docstring) -> its Link; `none` -> None. ValueError if malformed."""
    name, _, rest = spec.strip().partition(":")
    if name == "none" and not rest:
        return None
    if name not in PROFILES:
        raise ValueError(f"{spec!r}: unknown link {name!r}; profiles: none, {', '.join(PROFILES)}")
    changes: dict[str, float | None] = {}
    for item in filter(None, (x.strip() for x in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key.strip() not in FIELDS:
            raise ValueError(f"{spec!r}: {item!r} is not FIELD=VALUE with FIELD one of {', '.join(FIELDS)}")
        key, value = key.strip(), value.strip()
        try:
            changes[key] = None if key == "mbit" and value in ("0", "none") else float(value)
        except ValueError:
            raise ValueError(f"{spec!r}: {key}={value!r} is not a number") from None
    return PROFILES[name].overridden(changes)


@dataclass(frozen=True)
class Counters:
    """Bytes delivered each way (up: client -> upstream) and connections accepted, since the proxy started."""

    up: int = 0
    down: int = 0
    connections: int = 0

    def __sub__(self, other: Counters) -> Counters:
        return Counters(self.up - other.up, self.down - other.down, self.connections - other.connections)


class Wire:
    """One direction of a link: when each chunk is delivered (the timing model of the module docstring). Times are
    the event loop's clock; `t0` is when the stalls' schedule starts."""

    def __init__(self, link: Link, t0: float, rng: random.Random) -> None:
        self.link, self.t0, self.rng = link, t0, rng
        self.free = t0  # when the wire has sent everything given to it so far

    def _stall_end(self, t: float) -> float:
        """t, or the end of the stall t falls in."""
        every = self.link.stall_every_s
        if not self.link.stall_ms:
            return t
        k = math.floor((t - self.t0) / every)
        start = self.t0 + k * every
        return start + self.link.stall_ms / 1000 if k >= 1 and t < start + self.link.stall_ms / 1000 else t

    def _sent(self, start: float, n: int) -> float:
        """When n bytes that go on the wire at `start` have left it (a stall that begins meanwhile pauses them)."""
        if self.link.mbit is None:
            return start
        end = start + n * 8 / (self.link.mbit * 1e6)
        every = self.link.stall_every_s
        if self.link.stall_ms and end > self.t0 + (math.floor((start - self.t0) / every) + 1) * every:
            end += self.link.stall_ms / 1000
        return end

    def send(self, now: float, n: int) -> float:
        """Puts a chunk of n bytes read at `now` on the wire: when it has left it."""
        self.free = self._sent(self._stall_end(max(now, self.free)), n)
        return self.free

    def arrival(self, sent: float, previous: float) -> float:
        """When a chunk that left the wire at `sent` is delivered; `previous`: its connection's last delivery."""
        delay = self.link.delay_ms + (self.rng.gauss(0.0, self.link.jitter_ms) if self.link.jitter_ms else 0.0)
        return max(previous, self._stall_end(sent + max(0.0, delay) / 1000))


class _Direction:
    """One connection's one direction: chunks read from `reader`, delivered to `writer` when the wire says."""

    def __init__(self, wire: Wire, counts: dict[str, int], key: str) -> None:
        self.wire, self.counts, self.key = wire, counts, key
        self.queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        self.pending = 0
        self.drained = asyncio.Event()

    async def pump(self, reader: asyncio.StreamReader) -> None:
        loop, last = asyncio.get_running_loop(), 0.0
        try:
            while data := await reader.read(CHUNK):
                sent = self.wire.send(loop.time(), len(data))
                last = self.wire.arrival(sent, last)
                self.queue.put_nowait((last, data))
                self.pending += len(data)
                while (wait := sent - loop.time() - QUEUE_S) > 0:  # the sender waits, as behind a full window
                    await asyncio.sleep(wait)
                while self.pending > MAX_PENDING:
                    self.drained.clear()
                    await self.drained.wait()
        except OSError:
            pass
        finally:
            self.queue.put_nowait((last, b""))  # the end, after the last chunk

    async def deliver(self, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                due, data = await self.queue.get()
                if due - loop.time() > EARLY_S:
                    await asyncio.sleep(due - loop.time())
                if not data:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                self.counts[self.key] += len(data)  # first: a reader of the counters sees no delivery uncounted
                writer.write(data)
                self.pending -= len(data)
                if self.pending <= MAX_PENDING:
                    self.drained.set()
                await writer.drain()
        finally:
            self.pending = 0
            self.drained.set()


class LinkProxy:
    """Listens on 127.0.0.1:port (0: any free port, in `.port` once started) and forwards each connection to
    upstream through one `Link`: its two `Wire`s are shared by all the connections. Runs its event loop in a
    thread of its own; `seed` makes the jitter repeatable."""

    def __init__(
        self, upstream_host: str, upstream_port: int, link: Link, port: int = 0, seed: int | None = None
    ) -> None:
        self.upstream, self.link, self.port = (upstream_host, upstream_port), link, port
        self._rng = random.Random(seed)
        self._counts = {"up": 0, "down": 0, "connections": 0}
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="link-proxy")
        self._wires: tuple[Wire, Wire] | None = None

    def counters(self) -> Counters:
        """Bytes delivered each way and connections accepted so far."""
        return Counters(**self._counts)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self._wires is not None
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        self._counts["connections"] += 1
        up = _Direction(self._wires[0], self._counts, "up")
        down = _Direction(self._wires[1], self._counts, "down")
        tasks = [
            asyncio.ensure_future(c)
            for c in (up.pump(reader), up.deliver(up_writer), down.pump(up_reader), down.deliver(writer))
        ]
        try:
            # a delivery that fails (the far side gone) ends the connection both ways
            for task in asyncio.as_completed(tasks[1::2]):
                await task
            await asyncio.gather(*tasks[0::2])
        except OSError:
            pass
        finally:
            for w in (writer, up_writer):
                w.close()
            for t in tasks:
                t.cancel()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        t0 = self._loop.time()
        self._wires = (Wire(self.link, t0, self._rng), Wire(self.link, t0, self._rng))
        server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", self.port))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    def start(self) -> LinkProxy:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the link proxy did not start")
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)

    def __enter__(self) -> LinkProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class SpawnedLink:
    """A link proxy in a process of its own (`spawn_link`): its port, and its counters on request."""

    port: int
    proc: subprocess.Popen[str]

    def counters(self, timeout_s: float = 10.0) -> Counters:
        """Asks the process for its byte counters (its `--control` stdin)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("stats\n")
        self.proc.stdin.flush()
        if not select.select([self.proc.stdout], [], [], timeout_s)[0]:
            raise RuntimeError("the link proxy did not answer `stats`")
        return Counters(**json.loads(self.proc.stdout.readline()))


@contextmanager
def spawn_link(
    upstream_port: int, link: Link, upstream_host: str = "127.0.0.1", seed: int | None = None
) -> Iterator[SpawnedLink]:
    """Run a `LinkProxy` in a process of its own (a real link shares no interpreter lock with the worker); yields
    its port and counters. The process exits when this context ends (or its parent dies: its stdin closes)."""
    cmd = [sys.executable, "-m", "bench.link", "--upstream", f"{upstream_host}:{upstream_port}"]
    cmd += ["--profile", link.spec(), "--port", "0", "--control", *(["--seed", str(seed)] if seed is not None else [])]
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(cmd, cwd=repo, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        ready = select.select([proc.stdout], [], [], 30)[0] if proc.stdout else []
        line = proc.stdout.readline() if ready and proc.stdout else ""
        if not line.startswith("127.0.0.1:"):
            raise RuntimeError(f"the link proxy did not start: {line!r}")
        yield SpawnedLink(int(line.split()[0].rsplit(":", 1)[1]), proc)
    finally:
        proc.terminate()
        proc.wait(10)
        for pipe in (proc.stdin, proc.stdout):
            if pipe:
                with contextlib.suppress(OSError):
                    pipe.close()


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--upstream", default="127.0.0.1:6379", show_default=True, help="host:port to forward to.")
@click.option("--profile", "spec", default="wan", show_default=True, help="A link spec: a profile[:field=value,...].")
@click.option("--port", type=int, default=6380, show_default=True, help="Port to listen on (127.0.0.1; 0: any).")
@click.option("--delay-ms", type=click.FloatRange(0), default=None, help="Override: delay each way.")
@click.option("--jitter-ms", type=click.FloatRange(0), default=None, help="Override: jitter sd each way.")
@click.option("--mbit", type=click.FloatRange(0), default=None, help="Override: Mbit/s each way (0: no cap).")
@click.option("--stall-ms", type=click.FloatRange(0), default=None, help="Override: stall length (0: none).")
@click.option("--stall-every-s", type=click.FloatRange(0), default=None, help="Override: seconds between stalls.")
@click.option("--seed", type=int, default=None, help="Seed of the jitter's draws.")
@click.option("--control", is_flag=True, help="Commands on stdin (`stats`: counters as JSON); exit at its end.")
def main(
    upstream: str,
    spec: str,
    port: int,
    delay_ms: float | None,
    jitter_ms: float | None,
    mbit: float | None,
    stall_ms: float | None,
    stall_every_s: float | None,
    seed: int | None,
    control: bool,
) -> None:
    """Forward 127.0.0.1:PORT to UPSTREAM through an emulated link (see the module docstring)."""
    try:
        link = parse_link(spec)
        if link is None:
            raise ValueError("`none` is no proxy at all; `loopback` is the proxy with nothing added")
        changes = {"delay_ms": delay_ms, "jitter_ms": jitter_ms, "stall_ms": stall_ms, "stall_every_s": stall_every_s}
        link = link.overridden({**changes, **({"mbit": mbit or None} if mbit is not None else {})})
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--profile") from None
    host, up_port = upstream.rsplit(":", 1)
    proxy = LinkProxy(host, int(up_port), link, port, seed).start()
    click.echo(f"127.0.0.1:{proxy.port} -> {upstream} ({link.describe()})")
    sys.stdout.flush()
    if not control:
        with contextlib.suppress(KeyboardInterrupt):
            threading.Event().wait()
        click.echo(json.dumps(dataclasses.asdict(proxy.counters())))
        return
    for line in sys.stdin:
        if line.strip() == "stats":
            click.echo(json.dumps(dataclasses.asdict(proxy.counters())))
            sys.stdout.flush()


if __name__ == "__main__":
    main()
