"""Connect to Redis from a URL and retry transport errors (only those) with tenacity.

URLs: redis://[user:password@]host:port/db, rediss:// (TLS), unix:///path/to/socket?db=0. Job-level
failures are never retried here, and neither are refused credentials, a server certificate that
fails verification, or an error reply to the first PING (a DB index out of range, no permission):
those become one TransportError.

TLS options are redis-py's, as URL query options (every process, and RQ's scheduler connection,
inherits them from the one URL) or keyword arguments:
    rediss://user:pw@host:6380/0?ssl_ca_certs=/tls/ca.crt                      trust this CA
        &ssl_certfile=/tls/client.crt&ssl_keyfile=/tls/client.key              client certificate
        &ssl_cert_reqs=required&ssl_check_hostname=true                        (the defaults)
"""

from __future__ import annotations

import logging
import ssl
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlsplit

import redis
import redis.exceptions
from redis._parsers import _HiredisParser, _RESP2Parser
from redis.connection import Encoder, PythonRespSerializer
from redis.utils import HIREDIS_AVAILABLE
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from schemas.errors import TransportError
from schemas.settings import RedisSettings, Settings

log = logging.getLogger("shardflow.connection")
T = TypeVar("T")
TRANSPORT_ERRORS = (redis.ConnectionError, redis.TimeoutError, ConnectionError, TimeoutError)
AUTH_ERRORS = (redis.exceptions.AuthenticationError, redis.exceptions.AuthorizationError)


def _certificate_rejected(e: BaseException) -> bool:
    """The TLS handshake failed verifying the server's certificate (retrying cannot help)."""
    seen: BaseException | None = e
    for _ in range(8):  # the exception and what it was raised from
        if seen is None:
            break
        if isinstance(seen, ssl.SSLCertVerificationError):
            return True
        seen = seen.__cause__ or seen.__context__
    return "CERTIFICATE_VERIFY_FAILED" in str(e)


def _retryable(e: BaseException) -> bool:
    return isinstance(e, TRANSPORT_ERRORS) and not isinstance(e, AUTH_ERRORS) and not _certificate_rejected(e)


def _attempts_for(args: tuple) -> int:
    """settings.redis.connect_attempts of the object a method belongs to, else the documented default."""
    settings = getattr(args[0], "settings", None) if args else None
    return settings.redis.connect_attempts if isinstance(settings, Settings) else DEFAULT_ATTEMPTS


DEFAULT_ATTEMPTS: int = RedisSettings().connect_attempts


def transport_retry(attempts: int | None = None) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Decorator: retry on Redis transport errors with jittered backoff, then raise TransportError.
    `attempts` None: the `settings.redis.connect_attempts` of the method's object (schemas/settings.py)."""

    def wrap(fn: Callable[..., T]) -> Callable[..., T]:
        def call(*args: Any, **kwargs: Any) -> T:
            n = attempts if attempts is not None else _attempts_for(args)
            retrying = Retrying(
                retry=retry_if_exception(_retryable),
                stop=stop_after_attempt(n),
                wait=wait_exponential_jitter(multiplier=0.05, max=2.0),
                reraise=True,
            )
            try:
                return retrying(fn, *args, **kwargs)
            except AUTH_ERRORS as e:
                raise TransportError(f"Redis refused the credentials: {e}") from e
            except TRANSPORT_ERRORS as e:
                if _certificate_rejected(e):
                    raise TransportError(f"Redis's TLS certificate is not trusted (ssl_ca_certs?): {e}") from e
                raise TransportError(f"Redis unreachable after {n} attempts: {e}") from e

        call.__name__ = getattr(fn, "__name__", "call")
        call.__doc__ = fn.__doc__
        return call

    return wrap


def parser_options(hiredis: bool) -> dict[str, Any]:
    """How a connection parses replies and packs commands. hiredis (C) parses a multi-megabyte group entry about
    twice as fast as redis-py's Python parser, but packs a large XADD slower than redis-py's Python packer (it copies
    every argument): so replies are parsed by hiredis where it is installed and asked for, and commands are always
    packed in Python."""
    parser = _HiredisParser if hiredis and HIREDIS_AVAILABLE else _RESP2Parser
    encode = Encoder(encoding="utf-8", encoding_errors="strict", decode_responses=False).encode
    return {"parser_class": parser, "command_packer": PythonRespSerializer(6000, encode)}


def connect(
    url: str,
    *,
    username: str | None = None,
    password: str | None = None,
    check: bool = True,
    settings: Settings | None = None,
    attempts: int | None = None,
    max_connections: int | None = None,
    **kwargs: Any,
) -> redis.Redis:
    """Open a Redis client for `url` (bytes responses); PING it (`attempts` tries, default
    settings.redis.connect_attempts) unless check=False. `settings` (default: Settings()) gives the socket timeout.
    `max_connections`: a pool of at most that many connections whose callers wait for a free one (up to the
    socket timeout) instead of failing; default: redis-py's pool (100, then errors)."""
    settings = settings or Settings()
    attempts = attempts or settings.redis.connect_attempts
    opts: dict[str, Any] = {
        "socket_timeout": settings.redis.socket_timeout_s,
        "socket_connect_timeout": 10.0,
        "health_check_interval": 30,
        "driver_info": None,  # no CLIENT SETINFO: two round trips less per new connection over a WAN
    } | parser_options(settings.redis.hiredis)
    opts.update(kwargs)
    if username is not None:
        opts["username"] = username
    if password is not None:
        opts["password"] = password
    tls_opts = sorted(k for k in parse_qs(urlsplit(url).query) if k.startswith("ssl_"))
    if tls_opts and not url.startswith("rediss://"):
        raise TransportError(f"{', '.join(tls_opts)} need a rediss:// URL (TLS), not {url.split(':', 1)[0]}://")
    try:
        if max_connections is None:
            client = redis.Redis.from_url(url, **opts)
        else:
            pool = redis.BlockingConnectionPool.from_url(
                url, max_connections=max_connections, timeout=settings.redis.socket_timeout_s, **opts
            )
            client = redis.Redis(connection_pool=pool)
            client.auto_close_connection_pool = True
    except ValueError as e:
        raise TransportError(f"bad Redis URL {url!r}: {e}") from None
    if check:
        try:
            transport_retry(attempts)(client.ping)()
        except redis.ResponseError as e:  # NOPERM for PING, a DB index out of range, ...: not worth retrying
            db = client.connection_pool.connection_kwargs.get("db", 0)
            hint = f" (database {db} in the URL)" if "DB index" in str(e) else ""
            raise TransportError(f"Redis refused the connection: {e}{hint}") from e
    return client


def warm_pool(client: redis.Redis, n: int, parallel: int = 32) -> int:
    """Open up to `n` of the client's pooled connections now, `parallel` at a time, and leave them idle in
    the pool: a new connection costs several round trips (TCP, HELLO, AUTH, SELECT), which a burst of jobs
    would otherwise pay on its first round. Best effort: returns how many opened."""
    pool = client.connection_pool
    opened: list = []
    lock = threading.Lock()

    def one(_: int) -> None:
        try:
            conn = pool.get_connection()  # connects (and authenticates) it
        except Exception as e:  # the worker's own calls will report a Redis that refuses
            log.debug("warming a connection failed: %s", e)
            return
        with lock:
            opened.append(conn)

    with ThreadPoolExecutor(max(min(parallel, n), 1)) as ex:
        list(ex.map(one, range(n)))
    for conn in opened:
        pool.release(conn)
    return len(opened)
