"""What `shardflow doctor` measures of a Redis and the link to it, as the user a role runs under sees them.

Pure of click (producer/cli_doctor.py prints and predicts; this module only talks to Redis). `examine(r, url)` runs
every probe on one connection and returns `Finding`s, one per check, each with a verdict:

- `round trip`: a series of PINGs (default 30): median, p90 and jitter (mean absolute deviation from the mean);
- `bandwidth`: a timed write and read of a few MB (default 4 x 1 MiB, random bytes), pipelined, under a key the
  role may write, deleted after. Up = bytes / (time - one round trip), the same for down. Which key, by role
  (deploy/users.acl.template):
    head, head-NAME   SET / GET / DEL  {prefix}:ckpt:doctor.{random}  (its checkpoint keys)
    producer          SET / GET / DEL  {prefix}:api:doctor.{random}   (its `shardflow serve` keys)
    admin, default    SET / GET / DEL  {prefix}:doctor:{random}
    tail, tail-NAME   up: XADD NOMKSTREAM {prefix}:reply:head.doctor.{random}: the tail's one write, its verdicts,
                      sent to a stream that does not exist, so Redis reads every byte and stores nothing (a tail
                      may write no key it could read back or delete); down: ECHO of the same bytes, less the
                      upload (an estimate: a lower bound where the upload is the slower way).
  Every SET carries EX 60, so a doctor killed mid-probe leaves nothing for long;
- the server's settings (`redis version`, `tls`, `acl user`, `maxmemory`, `maxmemory-policy`, `maxclients`,
  `clock skew`): relay_broker/redis_checks.py, with the `Finding` every check returns.

Verdicts: ok, warn, fail, skip (could not be measured under this user). Commands a user may not run are tried at
most once each and answered NOPERM (they show in the server's ACL LOG as that user's denials).
"""

from __future__ import annotations

import functools
import os
import secrets
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import redis
import redis.exceptions

from relay_broker.redis_checks import (
    NOT_VISIBLE,
    Finding,
    Role,
    Verdict,
    _config,
    _refused,
    _try,
    clock_finding,
    memory_findings,
    role_of,
    tls_finding,
    user_finding,
    version_finding,
)
from schemas.keys import Keys

JITTER_WARN_SHARE, JITTER_WARN_S = 0.25, 0.005  # jitter over a quarter of the median, and over 5 ms
RTT_WARN_S = 0.2
PROBE_BUDGET_S = 10.0  # a probe's chunks after the first are sent only if they fit in this at the first's pace
TTL_S = 60  # every probe key expires, in case the doctor dies mid-probe


@dataclass(frozen=True)
class RoundTrip:
    median_s: float
    p90_s: float
    jitter_s: float  # mean absolute deviation from the mean
    samples: int


@dataclass(frozen=True)
class Bandwidth:
    up_Bps: float | None
    down_Bps: float | None
    how: str  # what was sent where, and what was left
    bytes_each_way: int = 0


@dataclass
class Examination:
    """What `examine` found: the checks in order, and the link figures the predictions use."""

    role: Role
    user: str | None
    findings: list[Finding]
    rtt: RoundTrip
    bandwidth: Bandwidth | None

    @property
    def failed(self) -> bool:
        return any(f.verdict == "fail" for f in self.findings)


# --- who is asking ------------------------------------------------------------------------------------------------


def ping_series(r: redis.Redis, n: int = 30) -> RoundTrip:
    """n PINGs one after another (after one that is not counted: it may open the connection)."""
    r.ping()
    samples = []
    for _ in range(max(n, 1)):
        t0 = time.perf_counter()
        r.ping()
        samples.append(time.perf_counter() - t0)
    return rtt_stats(samples)


def rtt_stats(samples: list[float]) -> RoundTrip:
    ordered = sorted(samples)
    mean = statistics.fmean(ordered)
    p90 = ordered[min(len(ordered) - 1, max(0, round(0.9 * len(ordered)) - 1))]
    jitter = statistics.fmean(abs(x - mean) for x in ordered)
    return RoundTrip(statistics.median(ordered), p90, jitter, len(ordered))


def round_trip_finding(rt: RoundTrip) -> Finding:
    ms = 1000.0
    detail = (
        f"median {rt.median_s * ms:.2f} ms, p90 {rt.p90_s * ms:.2f} ms, jitter {rt.jitter_s * ms:.2f} ms "
        f"(mean abs. deviation) over {rt.samples} PINGs"
    )
    verdict: Verdict = "ok"
    if rt.median_s > RTT_WARN_S:
        verdict, detail = "warn", detail + f"; over {RTT_WARN_S * ms:.0f} ms: every round waits at least this"
    if rt.jitter_s > max(JITTER_WARN_S, JITTER_WARN_SHARE * rt.median_s):
        verdict, detail = "warn", detail + "; round times swing: deadlines need headroom"
    values = {"median_ms": rt.median_s * ms, "p90_ms": rt.p90_s * ms, "jitter_ms": rt.jitter_s * ms}
    return Finding("round trip", verdict, detail, values | {"samples": rt.samples})


# --- bandwidth ----------------------------------------------------------------------------------------------------
def probe_key(role: Role, keys: Keys, token: str) -> tuple[str, str]:
    """(how, key): the probe a role can run and clean up after (module docstring): 'kv' SET/GET/DEL, or 'nomk'
    XADD NOMKSTREAM + ECHO."""
    if role == "head":
        return "kv", keys.checkpoint(f"doctor.{token}")
    if role == "producer":
        return "kv", f"{keys.prefix}:api:doctor.{token}"
    if role == "tail":
        return "nomk", keys.reply(f"head.doctor.{token}")
    return "kv", f"{keys.prefix}:doctor:{token}"


def _rate(nbytes: int, seconds: float, rtt_s: float) -> float:
    """Bytes a second delivered, the round trip taken out (at most 90% of the time: a fast local link)."""
    return nbytes / max(seconds - rtt_s, 0.1 * seconds, 1e-9)


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def bandwidth_probe(
    r: redis.Redis, role: Role, keys: Keys, rtt_s: float, total_bytes: int = 4 << 20, chunk: int = 1 << 20
) -> Bandwidth | Finding:
    """Delivered bytes a second up (to Redis) and down (module docstring), or a Finding saying why not (skip: the
    user may write no key the doctor uses; fail: Redis refused the write otherwise, e.g. out of memory or a replica)."""
    how, key = probe_key(role, keys, secrets.token_hex(6))
    chunk = max(1, min(chunk, total_bytes))
    payload = os.urandom(chunk)  # incompressible, as activations nearly are

    def write(pipe: Any) -> None:
        if how == "kv":
            pipe.set(key, payload, ex=TTL_S)
        else:
            pipe.execute_command("XADD", key, "NOMKSTREAM", "*", "d", payload)

    def run(step: Callable[[Any], None], n: int) -> tuple[list[Any], float]:
        pipe = r.pipeline(transaction=False)
        for _ in range(n):
            step(pipe)
        return _timed(pipe.execute)

    written = False
    try:
        first, t_first = run(write, 1)  # the permission check, and the pace for how many more fit
        written = how == "kv"
        if how == "nomk" and first[0] is not None:  # the stream existed after all: never write there again
            return Finding("bandwidth", "skip", f"{key} exists: not probed")
        pace = t_first / chunk
        n = max(1, min(total_bytes // chunk, int(PROBE_BUDGET_S / max(pace * chunk, 1e-9))))
        _, t_up = run(write, n)
        up = _rate(n * chunk, t_up, rtt_s)
        if how == "kv":
            got, t_down = run(lambda p: p.get(key), n)
            if any(g != payload for g in got):
                return Finding("bandwidth", "fail", f"{key} read back other bytes than were written")
            down: float | None = _rate(n * chunk, t_down, rtt_s)
            left = "deleted"
        else:
            got, t_echo = run(lambda p: p.execute_command("ECHO", payload), n)
            if any(g != payload for g in got):
                return Finding("bandwidth", "fail", "ECHO answered other bytes than were sent")
            down = _rate(n * chunk, t_echo - chunk / up, rtt_s)  # its upload overlaps all but the first chunk's
            left = "nothing stored (NOMKSTREAM); down from ECHO"
    except redis.ResponseError as e:
        if _refused(e):
            where = f"{how} probe on {key}"
            detail = f"this user may write no key the doctor uses ({where}: NOPERM; --role picks another)"
            return Finding("bandwidth", "skip", detail)
        # OOM (maxmemory reached under noeviction), READONLY (a replica), ...: writes of real jobs would fail too
        reason = str(e).rsplit("caused error: ", 1)[-1]  # not the pipeline's echo of the command and its bytes
        return Finding("bandwidth", "fail", f"Redis refused a {chunk} B write to {key}: {reason}")
    finally:
        if written:
            _try(lambda: r.delete(key))
    verb = "SET/GET" if how == "kv" else "XADD NOMKSTREAM"
    return Bandwidth(up, down, f"{n} x {chunk / (1 << 20):g} MiB {verb} on {key}, {left}", n * chunk)


def mbit(bps: float | None) -> str:
    """Bytes a second as Mbit/s and MB/s."""
    if bps is None:
        return "?"
    return f"{bps * 8 / 1e6:,.0f} Mbit/s = {bps / 1e6:,.1f} MB/s"


def bandwidth_finding(bw: Bandwidth) -> Finding:
    detail = f"up {mbit(bw.up_Bps)}, down {mbit(bw.down_Bps)} ({bw.how})"
    return Finding("bandwidth", "ok", detail, {"up_Bps": bw.up_Bps, "down_Bps": bw.down_Bps, "how": bw.how})


# --- the server ---------------------------------------------------------------------------------------------------
def examine(
    r: redis.Redis,
    url: str,
    prefix: str,
    *,
    role: Role | None = None,
    pings: int = 30,
    probe_bytes: int = 4 << 20,
    chunk: int = 1 << 20,
) -> Examination:
    """Every check, in the order they print (module docstring). `role` None: from the user name."""
    findings: list[Finding] = []
    rt = ping_series(r, pings)
    findings.append(round_trip_finding(rt))
    user_check, user = user_finding(r, url)
    role = role or role_of(user)
    bw = bandwidth_probe(r, role, Keys(prefix), rt.median_s, probe_bytes, chunk) if probe_bytes > 0 else None
    if bw is None:
        findings.append(Finding("bandwidth", "skip", "not probed (--probe-mb 0)"))
    elif isinstance(bw, Finding):
        findings.append(bw)
        bw = None
    else:
        findings.append(bandwidth_finding(bw))
    infos: dict[str, dict[str, Any] | None] = {}
    for section in ("server", "memory", "clients"):
        infos[section], why = _try(functools.partial(r.info, section))
        if why == NOT_VISIBLE:
            break  # one NOPERM is enough to know
    findings.append(version_finding(r, infos.get("server")))
    findings.append(tls_finding(r, url))
    findings.append(user_check)
    config: dict[str, str] = {}
    have = infos.get("memory") or {}
    if "maxmemory_policy" not in have or "maxclients" not in (infos.get("clients") or {}):
        config = _config(r, ["maxmemory", "maxmemory-policy", "maxclients"])
    findings += memory_findings(infos.get("memory"), infos.get("clients"), config)
    findings.append(clock_finding(r, infos.get("server") is not None))
    return Examination(role, user, findings, rt, bw)


def safe_url(url: str) -> str:
    """The URL with its password masked."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return parts._replace(netloc=netloc).geturl()
