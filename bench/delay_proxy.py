"""A userspace WAN-delay TCP proxy (the kernel here has no netem): every byte is forwarded after a fixed
delay in each direction, order preserved.

    python -m bench.delay_proxy --upstream 127.0.0.1:6379 --delay-ms 43 --port 6380
    with DelayProxy("127.0.0.1", 6379, 0.043) as proxy: connect(f"redis://127.0.0.1:{proxy.port}/0")
    with spawn_proxy(6379, 0.043) as port: ...   # in a process of its own (benchmarks: no shared GIL)
"""

from __future__ import annotations

import asyncio
import select
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import click


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    async def pump() -> None:
        while data := await reader.read(1 << 16):
            queue.put_nowait((loop.time() + delay_s, data))
        queue.put_nowait((loop.time() + delay_s, b""))

    async def deliver() -> None:
        while True:
            due, data = await queue.get()
            await asyncio.sleep(max(0.0, due - loop.time()))
            if not data:
                writer.close()
                return
            writer.write(data)
            await writer.drain()

    await asyncio.gather(pump(), deliver(), return_exceptions=True)


class DelayProxy:
    """Listens on 127.0.0.1:port and forwards to upstream with `delay_s` each way."""

    def __init__(self, upstream_host: str, upstream_port: int, delay_s: float, port: int = 0) -> None:
        self.upstream, self.delay_s, self.port = (upstream_host, upstream_port), delay_s, port
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="delay-proxy")

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        await asyncio.gather(_pipe(reader, up_writer, self.delay_s), _pipe(up_reader, writer, self.delay_s))

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", self.port))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    def start(self) -> DelayProxy:
        self._thread.start()
        self._ready.wait(10)
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)

    def __enter__(self) -> DelayProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextmanager
def spawn_proxy(upstream_port: int, delay_s: float, upstream_host: str = "127.0.0.1") -> Iterator[int]:
    """Run the proxy in a process of its own (a real link shares no interpreter lock with the head);
    yields the port it listens on."""
    upstream = f"{upstream_host}:{upstream_port}"
    cmd = [sys.executable, __file__, "--upstream", upstream, "--delay-ms", str(delay_s * 1000), "--port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        ready = select.select([proc.stdout], [], [], 30)[0] if proc.stdout else []
        line = proc.stdout.readline() if ready and proc.stdout else ""
        if not line.startswith("127.0.0.1:"):
            raise RuntimeError(f"delay proxy did not start: {line!r}")
        yield int(line.split()[0].rsplit(":", 1)[1])
    finally:
        proc.terminate()
        proc.wait(10)
        if proc.stdout:
            proc.stdout.close()


@click.command()
@click.option("--upstream", default="127.0.0.1:6379", show_default=True, help="host:port to forward to.")
@click.option("--delay-ms", type=float, default=43.0, show_default=True, help="Delay each way.")
@click.option("--port", type=int, default=6380, show_default=True, help="Port to listen on (127.0.0.1).")
def main(upstream: str, delay_ms: float, port: int) -> None:
    host, up_port = upstream.rsplit(":", 1)
    proxy = DelayProxy(host, int(up_port), delay_ms / 1000, port).start()
    click.echo(f"127.0.0.1:{proxy.port} -> {upstream} (+{delay_ms} ms each way); Ctrl-C stops", nl=True)
    sys.stdout.flush()
    threading.Event().wait()


if __name__ == "__main__":
    main()
