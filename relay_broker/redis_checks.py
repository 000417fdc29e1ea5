"""What `shardflow doctor` checks of a Redis server's settings, as the user a role runs under sees them, and the
`Finding` every check of the doctor returns (relay_broker/doctor.py: the link's round trip and bandwidth, and
`examine`, which runs them all).

- `redis version` (HELLO, which every user may send; 6.2 has no ACL selectors: warn; older lacks XAUTOCLAIM:
  fail), `tls` (from the connection: rediss://, unix socket, or plain TCP to another host: warn), `acl user`
  (ACL WHOAMI, else the URL's user name; the default user or admin: warn);
- `maxmemory`, `maxmemory-policy` (RQ needs noeviction: any other policy can evict queued jobs silently: fail),
  `maxclients`: from INFO (head and producer may run it), else CONFIG GET (admin); "not visible to this user"
  otherwise (a tail may run neither);
- `clock skew`: Redis's clock (INFO's server_time_usec, else TIME) against this machine's, at the midpoint of the
  call (± half its round trip); over 1 s warns: job timeouts, heartbeats and RQ's registries mix both clocks.
"""

from __future__ import annotations

import functools
import ipaddress
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

import redis
import redis.exceptions

Verdict = Literal["ok", "warn", "fail", "skip"]
Role = Literal["head", "tail", "producer", "admin", "other"]
NOT_VISIBLE = "not visible to this user"
SKEW_WARN_S = 1.0
MIN_VERSION, ACL_VERSION = (6, 2), (7, 0)  # XAUTOCLAIM and NOMKSTREAM; the ACL file's selectors
MIN_MAXCLIENTS = 1024  # a head opens a pool of connections (warm_pool) and one per sender and reader thread
MEMORY_WARN_SHARE = 0.8


@dataclass(frozen=True)
class Finding:
    """One check: its verdict, one line for people, and its figures for --json."""

    name: str
    verdict: Verdict
    detail: str
    values: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def url_user(url: str) -> str | None:
    """The user name a URL logs in as (None: the default user, or a password alone)."""
    parts = urlsplit(url)
    return unquote(parts.username) if parts.username else None


def _refused(e: Exception) -> bool:
    """A command this user may not run (or this server does not know): the check is skipped, not failed."""
    text = str(e).lower()
    return isinstance(e, redis.exceptions.NoPermissionError) or "noperm" in text or "unknown command" in text


def _try(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    """fn()'s value, or (None, why) where Redis refused it for this user."""
    try:
        return fn(), None
    except redis.ResponseError as e:
        if _refused(e):
            return None, NOT_VISIBLE
        return None, f"{type(e).__name__}: {e}"


def _text(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


# --- round trip ---------------------------------------------------------------------------------------------------


def _pairs(reply: Any) -> dict[str, Any]:
    """HELLO's answer as a dict (RESP2: a flat list of names and values)."""
    if isinstance(reply, dict):
        return {_text(k): v for k, v in reply.items()}
    items = list(reply or [])
    return {_text(items[i]): items[i + 1] for i in range(0, len(items) - 1, 2)}


def _version(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(".")[:3])
    except ValueError:
        return ()


def version_finding(r: redis.Redis, info_server: dict[str, Any] | None) -> Finding:
    """HELLO 2 (kept on RESP2) names the server's version to any user; INFO where HELLO is unknown (before 6)."""
    hello, _ = _try(lambda: _pairs(r.execute_command("HELLO", "2")))
    version = _text(hello["version"]) if hello and "version" in hello else None
    if version is None and info_server:
        version = str(info_server.get("redis_version"))
    if version is None:
        return Finding("redis version", "warn", NOT_VISIBLE)
    v = _version(version)
    mode = f"{_text(hello.get('mode', '?'))} {_text(hello.get('role', '?'))}" if hello else "?"
    detail, verdict = f"{version} ({mode})", "ok"
    if v and v < MIN_VERSION:
        verdict, detail = "fail", detail + ": ShardFlow needs 6.2 or later (XAUTOCLAIM, XADD NOMKSTREAM)"
    elif v and v < ACL_VERSION:
        verdict, detail = "warn", detail + ": the ACL file (deploy/users.acl.template) needs 7.0"
    if hello and _text(hello.get("role", "")) == "replica":
        verdict, detail = "fail", detail + ": a replica refuses writes"
    return Finding("redis version", verdict, detail, {"version": version})  # type: ignore[arg-type]


def _loopback(host: str | None) -> bool:
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def tls_finding(r: redis.Redis, url: str) -> Finding:
    """TLS from the connection itself (its class and, once connected, its protocol), checked against the URL."""
    parts = urlsplit(url)
    kwargs = r.connection_pool.connection_kwargs
    cls = r.connection_pool.connection_class.__name__
    if parts.scheme == "unix" or cls == "UnixDomainSocketConnection":
        return Finding("tls", "ok", f"off: a unix socket ({parts.path}), local", {"tls": False, "local": True})
    if cls == "SSLConnection":
        conn = r.connection_pool.get_connection()
        try:
            sock = getattr(conn, "_sock", None)
            proto = sock.version() if sock is not None and hasattr(sock, "version") else None
        finally:
            r.connection_pool.release(conn)
        reqs = str(kwargs.get("ssl_cert_reqs", "required")).lower()
        detail = f"on ({proto or 'TLS'}; server certificate {'checked' if 'none' not in reqs else 'NOT checked'}"
        detail += ", client certificate sent)" if kwargs.get("ssl_certfile") else ", no client certificate)"
        verdict: Verdict = "warn" if "none" in reqs else "ok"
        return Finding("tls", verdict, detail, {"tls": True, "protocol": proto, "verified": verdict == "ok"})
    host = parts.hostname
    if _loopback(host):
        return Finding("tls", "ok", f"off: a local connection ({host})", {"tls": False, "local": True})
    detail = f"off: plain TCP to {host}: passwords, prompts and activations cross the network in clear (rediss://)"
    return Finding("tls", "warn", detail, {"tls": False, "local": False})


def user_finding(r: redis.Redis, url: str) -> tuple[Finding, str | None]:
    """The ACL user (ACL WHOAMI where allowed, else the URL's), and what it says about least privilege."""
    whoami, why = _try(lambda: _text(r.execute_command("ACL", "WHOAMI")))
    user = whoami or url_user(url) or r.connection_pool.connection_kwargs.get("username")
    source = "ACL WHOAMI" if whoami else "the URL's; ACL WHOAMI is not allowed for it" if why else "the URL's"
    if user is None:
        detail = "the default user (no user name in the URL): give each process its role's ACL user"
        return Finding("acl user", "warn", detail, {"user": "default"}), None
    if user in ("default", "admin"):
        detail = f"{user} ({source}): every command on every key; give each process its role's user (docs/security.md)"
        return Finding("acl user", "warn", detail, {"user": user}), user
    role = role_of(user)
    detail = f"{user} ({source})" + ("" if role != "other" else ": no role of deploy/users.acl.template")
    return Finding("acl user", "ok", detail, {"user": user, "role": role}), user


def _config(r: redis.Redis, names: list[str]) -> dict[str, str]:
    """CONFIG GET of these names (admin only under the ACL file): {} where refused."""
    got, _ = _try(lambda: r.config_get(*names) if len(names) > 1 else r.config_get(names[0]))
    if got is None and len(names) > 1:  # Redis 6.2 takes one pattern a call
        got = {}
        for name in names:
            one, why = _try(functools.partial(r.config_get, name))
            if why == NOT_VISIBLE:
                return {}
            got.update(one or {})
    return {_text(k): _text(v) for k, v in (got or {}).items()}


def _size(n: int) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def memory_findings(
    info_memory: dict[str, Any] | None, info_clients: dict[str, Any] | None, config: dict[str, str]
) -> list[Finding]:
    """maxmemory, maxmemory-policy and maxclients from INFO, else CONFIG GET, else not visible."""
    mem, clients = info_memory or {}, info_clients or {}
    out = []
    maxmemory = mem.get("maxmemory", config.get("maxmemory"))
    used = mem.get("used_memory")
    if maxmemory is None:
        out.append(Finding("maxmemory", "skip", NOT_VISIBLE))
    else:
        cap = int(maxmemory)
        used_s = f", used {_size(int(used))}" if used is not None else ""
        if cap == 0:
            out.append(Finding("maxmemory", "ok", f"no limit{used_s}", {"maxmemory": 0, "used": used}))
        elif used is not None and int(used) >= MEMORY_WARN_SHARE * cap:
            detail = f"{_size(cap)}{used_s}: over {MEMORY_WARN_SHARE:.0%}, writes fail when it is full"
            out.append(Finding("maxmemory", "warn", detail, {"maxmemory": cap, "used": used}))
        else:
            out.append(Finding("maxmemory", "ok", f"{_size(cap)}{used_s}", {"maxmemory": cap, "used": used}))
    policy = mem.get("maxmemory_policy", config.get("maxmemory-policy"))
    if policy is None:
        detail = f"{NOT_VISIBLE}: make sure it is noeviction (run the doctor as head or producer, or ask an operator)"
        out.append(Finding("maxmemory-policy", "warn", detail))
    elif policy == "noeviction":
        out.append(Finding("maxmemory-policy", "ok", "noeviction", {"policy": policy}))
    else:
        detail = f"{policy}: Redis may evict queued jobs, results and streams silently; RQ needs noeviction"
        out.append(Finding("maxmemory-policy", "fail", detail, {"policy": policy}))
    maxclients = clients.get("maxclients", config.get("maxclients"))
    if maxclients is None:
        out.append(Finding("maxclients", "skip", NOT_VISIBLE))
    else:
        cap, now = int(maxclients), clients.get("connected_clients")
        detail = f"{cap}" + (f" ({now} connected)" if now is not None else "")
        verdict: Verdict = "ok"
        if cap < MIN_MAXCLIENTS:
            verdict, detail = "warn", detail + f": under {MIN_MAXCLIENTS}; every head opens a pool of connections"
        elif now is not None and int(now) >= MEMORY_WARN_SHARE * cap:
            verdict, detail = "warn", detail + f": over {MEMORY_WARN_SHARE:.0%} in use"
        out.append(Finding("maxclients", verdict, detail, {"maxclients": cap, "connected": now}))
    return out


def clock_finding(r: redis.Redis, can_info: bool, clock: Callable[[], float] = time.time) -> Finding:
    """Redis's clock against this machine's (`clock`): INFO server's server_time_usec (Redis 7), else TIME."""
    t0 = clock()
    server_s: float | None = None
    if can_info:
        info, _ = _try(lambda: r.info("server"))
        if info and "server_time_usec" in info:
            server_s = int(info["server_time_usec"]) / 1e6
    if server_s is None:
        t0 = clock()
        now, _ = _try(r.time)
        if now is not None:
            server_s = now[0] + now[1] / 1e6
    t1 = clock()
    if server_s is None:
        return Finding("clock skew", "skip", f"{NOT_VISIBLE} (neither INFO nor TIME)")
    skew, within = server_s - (t0 + t1) / 2, (t1 - t0) / 2
    detail = f"{skew:+.3f} s (± {within:.3f} s): Redis's clock against this machine's"
    verdict: Verdict = "ok"
    if abs(skew) - within > SKEW_WARN_S:
        verdict = "warn"
        detail += f"; over {SKEW_WARN_S:g} s: job timeouts and heartbeats mix both clocks (sync with NTP)"
    return Finding("clock skew", verdict, detail, {"skew_s": skew, "uncertainty_s": within})


# --- all of it ----------------------------------------------------------------------------------------------------


def role_of(user: str | None) -> Role:
    """The role a user name of deploy/users.acl.template plays (head-NAME: head; tail-NAME, stage, stage-NAME:
    tail)."""
    if user is None or user == "default":
        return "admin"  # no ACL user: every command, like admin (its own warning comes from `acl user`)
    for role in ("head", "tail"):
        if user == role or user.startswith(f"{role}-"):
            return role  # type: ignore[return-value]
    if user == "stage" or user.startswith("stage-"):
        return "tail"  # a middle stage's user probes as a tail's does (XADD NOMKSTREAM to a reply stream)
    if user in ("producer", "admin"):
        return user  # type: ignore[return-value]
    return "other"
