"""A TLS-only redis-server loaded with the shipped ACL file (deploy/users.acl.template rendered with
random test passwords), with a CA, server and client certificates made by the openssl CLI at test
time: the `pki` and `secured` fixtures and helpers of tests/test_security.py, and its tables of what each
role must not do (ADMIN_COMMANDS, SCRIPTING, ROLE_DENIALS) and what it needs (ROLE_NEEDS, via ACL DRYRUN)."""

from __future__ import annotations

import importlib.util
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from relay_broker.connection import connect
from relay_broker.embedded import EmbeddedRedis, TLSFiles, tls_redis_server

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("render_acl", ROOT / "deploy" / "render_acl.py")
assert _spec is not None and _spec.loader is not None
render_acl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render_acl)

NAMED_HEADS, NAMED_TAILS = ("iso-a", "iso-b"), ("iso-t1", "iso-t2")  # workers with users of their own (issue 56)
NAMED_STAGES = ("iso-s1", "iso-s2")  # middle stages with users of their own (issue 59)
ROLES = (
    "admin",
    "producer",
    "head",
    "tail",
    "stage",
    *(f"head-{n}" for n in NAMED_HEADS),
    *(f"tail-{n}" for n in NAMED_TAILS),
    *(f"stage-{n}" for n in NAMED_STAGES),
)
PREFIX, QUEUE, SPLIT, N_LAYERS = "shardflow", "secq", 2, 4
CALLBACK_MARKER = "SHARDFLOW_TEST_CALLBACK_MARKER"


def acl_values(passwords: dict[str, str]) -> dict[str, str]:
    """What render_acl reads for these users' passwords (a named worker's: REDIS_HEAD_ISO_A_PASSWORD) and names."""
    values = {f"REDIS_{role.upper().replace('-', '_')}_PASSWORD": pw for role, pw in passwords.items()}
    names = {"HEADS": NAMED_HEADS, "TAILS": NAMED_TAILS, "STAGES": NAMED_STAGES}
    return values | {f"SHARDFLOW_ACL_{role}": ",".join(n) for role, n in names.items()}


# --- certificates, made with the openssl CLI (nothing committed) -----------------------------------
def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


EC_KEY = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"


def _ca(d: Path, name: str) -> None:
    _openssl(*f"req -x509 {EC_KEY} -keyout {name}.key -out {name}.crt -days 2 -subj /CN={name}".split(), cwd=d)


def _leaf(d: Path, name: str, ca: str, ext: str) -> None:
    """A key and a certificate for `name`, signed by `ca`, with the X.509 extensions `ext`."""
    (d / f"{name}.ext").write_text(ext + "\n")
    _openssl(*f"req {EC_KEY} -keyout {name}.key -out {name}.csr -subj /CN={name}".split(), cwd=d)
    sign = f"x509 -req -in {name}.csr -CA {ca}.crt -CAkey {ca}.key -CAcreateserial -out {name}.crt -days 2"
    _openssl(*sign.split(), "-extfile", f"{name}.ext", cwd=d)


@pytest.fixture(scope="session")  # one CA and one TLS + ACL server for test_security and test_acl
def pki(tmp_path_factory) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl CLI to make test certificates (scripts/test.sh installs it as root)")
    d = tmp_path_factory.mktemp("pki")
    _ca(d, "ca")
    _ca(d, "rogue-ca")
    _leaf(d, "server", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth")
    _leaf(d, "client", "ca", "extendedKeyUsage=clientAuth")
    _leaf(d, "rogue-client", "rogue-ca", "extendedKeyUsage=clientAuth")
    return d


# --- one TLS-only redis-server with the shipped ACL file --------------------------------------------
class Secured:
    """The server, the test passwords, and a URL / client per role."""

    def __init__(self, server: EmbeddedRedis, passwords: dict[str, str], pki: Path) -> None:
        self.server, self.passwords, self.pki = server, passwords, pki

    def url(self, role: str) -> str:
        return self.server.url_for(role, self.passwords[role])

    def client(self, role: str, **kwargs) -> redis.Redis:
        return connect(self.url(role), attempts=1, **kwargs)


@pytest.fixture(scope="session")
def secured(pki, tmp_path_factory) -> Iterator[Secured]:
    binary = tls_redis_server()
    if binary is None:
        pytest.skip("no redis-server 7+ built with TLS (apt-get install redis-server; scripts/test.sh does as root)")
    passwords = {role: secrets.token_hex(24) for role in ROLES}
    values = acl_values(passwords) | {"SHARDFLOW_REDIS__PREFIX": PREFIX}
    acl = tmp_path_factory.mktemp("acl") / "users.acl"
    render_acl.write_atomic(acl, render_acl.render(render_acl.TEMPLATE.read_text(), values))
    tls = TLSFiles(pki / "ca.crt", pki / "server.crt", pki / "server.key", pki / "client.crt", pki / "client.key")
    server = EmbeddedRedis(
        binary=binary,
        aclfile=acl,
        tls=tls,
        username="admin",
        password=passwords["admin"],
        extra_args=["--enable-debug-command", "yes"],  # so that only the ACL stands between a role and DEBUG
    )
    with server:
        yield Secured(server, passwords, pki)


def _refused(r: redis.Redis, *args: str) -> str:
    """Send one raw command and return its NOPERM error text (fails if the command is allowed)."""
    conn = r.connection_pool.get_connection()
    try:
        conn.send_command(*args)
        with pytest.raises(redis.exceptions.NoPermissionError) as e:
            conn.read_response()
    finally:
        conn.disconnect()
        r.connection_pool.release(conn)
    return str(e.value)


# --- what each role must not do, and what it needs (tests/test_security.py) ---------------------------
ADMIN_COMMANDS = [
    ("FLUSHALL",),
    ("FLUSHDB",),
    ("CONFIG", "GET", "*"),
    ("CONFIG", "SET", "appendonly", "no"),
    ("DEBUG", "SLEEP", "0"),
    ("ACL", "LIST"),
    ("ACL", "SETUSER", "evil", "on", ">evil-password", "~*", "+@all"),
    ("KEYS", "*"),
    ("SCAN", "0"),
    ("MONITOR",),
    ("CLIENT", "LIST"),
    ("CLIENT", "KILL", "TYPE", "normal"),
    ("CLIENT", "TRACKING", "on", "BCAST"),
    ("SHUTDOWN", "NOSAVE"),
    ("SCRIPT", "FLUSH"),
    ("FUNCTION", "FLUSH"),
    ("PUBLISH", "rq:pubsub:any-worker", '{"command": "shutdown"}'),
]
# No role but admin runs Lua: one endless script answers BUSY to everyone until an admin's SCRIPT KILL.
SCRIPTING = [
    ("EVAL", "while true do end", "0"),
    ("EVAL", "return 1", "0"),
    ("EVALSHA", "e0e1f9fabfc9d4800c877a703b823ac0578ff8db", "0"),
    ("EVAL_RO", "return 1", "0"),
    ("EVALSHA_RO", "e0e1f9fabfc9d4800c877a703b823ac0578ff8db", "0"),
    ("FCALL", "any_function", "0"),
    ("FCALL_RO", "any_function", "0"),
    ("SCRIPT", "LOAD", "return 1"),
    ("SCRIPT", "EXISTS", "e0e1f9fabfc9d4800c877a703b823ac0578ff8db"),
    ("SCRIPT", "KILL"),
    ("FUNCTION", "LOAD", "#!lua name=evil\nredis.register_function('f', function() while true do end end)"),
]
# RQ keys only head workers write: results (a forged entry breaks Job.latest_result() for everyone),
# worker records and sets, the scheduler's lock and record, executions, suspension, rate limits.
RQ_WORKER_KEYS = [
    ("XADD", "rq:results:some-job", "*", "a", "b"),
    ("DEL", "rq:results:some-job"),
    ("HSET", "rq:worker:some-worker", "a", "b"),
    ("DEL", "rq:worker:some-worker"),
    ("DEL", "rq:workers"),
    ("SADD", "rq:workers", "rq:worker:forged"),
    ("SADD", f"rq:workers:{QUEUE}", "rq:worker:forged"),
    ("SET", f"rq:scheduler-lock:{QUEUE}", "forged"),
    ("DEL", f"rq:scheduler-lock:{QUEUE}"),
    ("HSET", "rq:scheduler:some-scheduler", "a", "b"),
    ("ZADD", "rq:executions:some-job", "1", "x"),
    ("SET", "rq:suspended", "1"),
    ("SADD", "rq:rl-keys", "forged"),
]
ROLE_DENIALS = {
    "producer": [
        ("XADD", f"{PREFIX}:tail:requests", "*", "h", "forged"),
        ("XADD", f"{PREFIX}:tail:some-tail:requests", "*", "h", "forged"),
        ("XRANGE", f"{PREFIX}:tail:requests", "-", "+"),
        ("XREAD", "STREAMS", f"{PREFIX}:reply:some-session", "0"),
        ("DEL", f"{PREFIX}:reply:some-session"),
        ("SET", f"{PREFIX}:result:some-job", "{}"),
        ("SET", f"{PREFIX}:ckpt:some-job", "{}"),
        ("SET", f"{PREFIX}:model:{QUEUE}", "{}"),
        ("GET", f"{PREFIX}:cancel:some-job"),
        ("SUBSCRIBE", "rq:pubsub:any-worker"),
        ("SET", "elsewhere", "1"),
        *RQ_WORKER_KEYS,
    ],
    "tail": [
        ("XREAD", "STREAMS", f"{PREFIX}:reply:some-session", "0"),
        ("HGETALL", "rq:job:some-job"),
        ("RPUSH", f"rq:queue:{QUEUE}", "job"),
        ("GET", f"{PREFIX}:result:some-job"),
        ("SET", f"{PREFIX}:result:some-job", "{}"),
        ("XADD", f"{PREFIX}:tokens:some-job", "*", "text", "x"),
        ("SET", f"{PREFIX}:ckpt:some-job", "{}"),
        ("SUBSCRIBE", "rq:pubsub:any-worker"),
        *RQ_WORKER_KEYS,
    ],
    "head": [
        ("XRANGE", f"{PREFIX}:tail:requests", "-", "+"),
        ("XREADGROUP", "GROUP", f"{PREFIX}:tails", "h", "STREAMS", f"{PREFIX}:tail:requests", ">"),
        ("SET", f"{PREFIX}:cancel:some-job", "1"),
        ("HGETALL", f"{PREFIX}:batch:some-batch"),
        ("XREAD", "STREAMS", f"{PREFIX}:tokens:some-job", "0"),
        ("GET", f"{PREFIX}:model:{QUEUE}"),
        ("SET", "elsewhere", "1"),
    ],
}


T, Q, SCHED_LOCK = f"{PREFIX}:tail:requests", f"rq:queue:{QUEUE}", f"rq:scheduler-lock:{QUEUE}"
STAGE_SHARED, STAGE_GROUP = f"{PREFIX}:stage:1-3:requests", f"{PREFIX}:stage:1-3:stages"
STAGE_OWN = f"{PREFIX}:stage:s1:requests"  # a stage's own stream (a named stage's: stage:NAME:requests)
ROLE_NEEDS = {
    "producer": [  # the RQ client: enqueue, cancel, requeue; reads of status, results, workers; its own keys
        ("HSET", "rq:job:j", "status", "queued"),
        ("EXPIRE", "rq:job:j", "60"),
        ("RPUSH", Q, "j"),
        ("LREM", Q, "0", "j"),
        ("SADD", "rq:queues", Q),
        ("SADD", "rq:group:b", "j"),
        ("SADD", "rq:groups", "b"),
        ("ZADD", f"rq:canceled:{QUEUE}", "1", "j"),
        ("ZREM", f"rq:failed:{QUEUE}", "j"),
        ("ZREM", f"rq:wip:{QUEUE}", "j:e"),
        ("ZADD", f"rq:scheduled:{QUEUE}", "1", "j"),
        ("ZREM", f"rq:deferred:{QUEUE}", "j"),
        ("ZCARD", f"rq:finished:{QUEUE}"),
        ("XREVRANGE", "rq:results:j", "+", "-", "COUNT", "1"),
        ("SMEMBERS", "rq:workers"),
        ("SMEMBERS", f"rq:workers:{QUEUE}"),
        ("HMGET", "rq:worker:w", "state", "queues"),
        ("ZRANGE", "rq:executions:j", "0", "-1"),
        ("HSET", f"{PREFIX}:batch:b", "count", "1"),
        ("GET", f"{PREFIX}:result:j"),
        ("GET", f"{PREFIX}:model:{QUEUE}"),
        ("XREAD", "STREAMS", f"{PREFIX}:tokens:j", "0"),
        ("XREAD", "COUNT", "64", "BLOCK", "10", "STREAMS", f"{PREFIX}:tokens:j", f"{PREFIX}:tokens:k", "0", "5-0"),
        ("TYPE", f"{PREFIX}:tokens:j"),  # a key another client type-broke is read no more
        ("MGET", f"{PREFIX}:result:j", f"{PREFIX}:result:k"),
        ("SET", f"{PREFIX}:cancel:j", "1", "EX", "60"),
        ("DEL", f"{PREFIX}:cancel:j"),
        ("EXISTS", f"{PREFIX}:batch:b", "rq:group:b"),
        ("HSET", f"{PREFIX}:api:file:f", "a", "b"),
        ("ZADD", f"{PREFIX}:api:batches", "1", "b"),
        ("INFO", "server"),
    ],
    "head": [  # an RQ worker and its scheduler thread (lock without Lua), and the head's relay keys
        ("SET", SCHED_LOCK, "s", "NX", "EX", "8"),
        ("WATCH", SCHED_LOCK),
        ("GET", SCHED_LOCK),
        ("EXPIRE", SCHED_LOCK, "8"),
        ("DEL", SCHED_LOCK),
        ("HSET", "rq:scheduler:s", "pid", "1"),
        ("XADD", "rq:results:j", "*", "a", "b"),
        ("HSET", "rq:worker:w", "state", "idle"),
        ("SADD", "rq:workers", "rq:worker:w"),
        ("SADD", f"rq:workers:{QUEUE}", "rq:worker:w"),
        ("BLMOVE", Q, f"{Q}:intermediate", "LEFT", "RIGHT", "1"),
        ("ZADD", f"rq:wip:{QUEUE}", "1", "j:e"),
        ("ZADD", "rq:executions:j", "1", "e"),
        ("SUBSCRIBE", "rq:pubsub:w"),
        ("XADD", T, "*", "h", "x"),
        ("XREAD", "STREAMS", f"{PREFIX}:reply:s", "0"),
        ("DEL", f"{PREFIX}:reply:s"),
        ("XADD", f"{PREFIX}:tail:t1:requests", "MAXLEN", "~", "100", "*", "h", "x"),
        ("ZRANGEBYSCORE", f"{PREFIX}:stages", "1700000000.5", "+inf"),  # the middle stages' route (routes.py)
        ("XADD", f"{PREFIX}:stage:1-3:requests", "MAXLEN", "~", "100", "*", "h", "x"),  # a round, through a stage
        ("XADD", STAGE_OWN, "MAXLEN", "~", "100", "*", "h", "x"),  # a pinned round, a close
        ("SET", f"{PREFIX}:result:j", "{}", "NX", "EX", "60"),
        ("GET", f"{PREFIX}:result:j"),
        ("SET", f"{PREFIX}:ckpt:j", "{}", "EX", "60"),
        ("GET", f"{PREFIX}:ckpt:j"),
        ("DEL", f"{PREFIX}:ckpt:j"),
        ("XADD", f"{PREFIX}:tokens:j", "5-0", "text", "x"),
        ("EXPIRE", f"{PREFIX}:tokens:j", "60"),
        ("DEL", f"{PREFIX}:tokens:j"),  # a fresh attempt of a retried job resets its stream
        ("XREVRANGE", f"{PREFIX}:tokens:j", "+", "-", "COUNT", "1"),  # is a refused write's entry there?
        ("EXISTS", f"{PREFIX}:cancel:j"),
        ("SET", f"{PREFIX}:model:{QUEUE}", "{}"),
        ("XADD", f"{PREFIX}:dead-letters", "MAXLEN", "~", "100", "*", "h", "x"),  # a refused reply's record
        ("SET", f"{PREFIX}:head:h1", "boot", "PX", "30000"),  # its liveness key
        ("GET", f"{PREFIX}:head:h1"),
        ("DEL", f"{PREFIX}:head:h1"),
        *(
            HEAD_STREAM_NEEDS := [  # its reply stream, made, kept and read by workers/head/beacon.py and relay_io.py
                ("XGROUP", "CREATE", f"{PREFIX}:reply:head.h1.b", "head.b", "0", "MKSTREAM"),
                ("EXPIRE", f"{PREFIX}:reply:head.h1.b", "600"),
                ("XREVRANGE", f"{PREFIX}:reply:head.h1.b", "+", "-", "COUNT", "1"),
                (
                    "XREADGROUP",
                    "GROUP",
                    "head.b",
                    "r0",
                    "COUNT",
                    "10",
                    "NOACK",
                    "STREAMS",
                    f"{PREFIX}:reply:head.h1.b",
                    ">",
                ),
                ("XGROUP", "CREATE", f"{PREFIX}:reply:head.h1.b.1", "head.b", "0", "MKSTREAM"),  # a fresh epoch
            ]
        ),
    ],
    "tail": [  # its consumer group on the request streams, replies, dead letters
        ("XGROUP", "CREATE", T, "g", "$", "MKSTREAM"),
        ("XREADGROUP", "GROUP", "g", "c", "STREAMS", T, ">"),
        ("XACK", T, "g", "1-0"),
        ("XDEL", T, "1-0"),
        ("XAUTOCLAIM", T, "g", "c", "1000", "0"),
        ("XINFO", "CONSUMERS", T, "g"),
        ("XGROUP", "DELCONSUMER", T, "g", "c"),
        ("XGROUP", "CREATE", f"{PREFIX}:tail:t1:requests", "g", "0", "MKSTREAM"),
        ("EXPIRE", f"{PREFIX}:tail:t1:requests", "3600"),  # its own stream outlives it
        ("XADD", f"{PREFIX}:reply:head.h1.b", "NOMKSTREAM", "MAXLEN", "~", "10000", "*", "a", "b"),
        ("XADD", f"{PREFIX}:dead-letters", "MAXLEN", "~", "100", "*", "a", "b"),
        ("GET", f"{PREFIX}:head:h1"),  # is a session's head still running?
        ("MGET", f"{PREFIX}:head:h1", f"{PREFIX}:head:h2"),
    ],
    "stage": [  # a middle stage (workers/stage/server.py): the tail's reads on its range's and its own stream, ...
        ("XGROUP", "CREATE", STAGE_SHARED, STAGE_GROUP, "0", "MKSTREAM"),
        ("XGROUP", "CREATE", STAGE_OWN, STAGE_GROUP, "0", "MKSTREAM"),
        ("XREADGROUP", "GROUP", STAGE_GROUP, "s1", "COUNT", "4", "STREAMS", STAGE_SHARED, STAGE_OWN, "0", "0"),
        ("XAUTOCLAIM", STAGE_SHARED, STAGE_GROUP, "s1", "30000", "0-0", "COUNT", "4"),
        ("XACK", STAGE_SHARED, STAGE_GROUP, "1-0"),
        ("XDEL", STAGE_OWN, "1-0"),
        ("EXPIRE", STAGE_OWN, "3600"),  # its own stream outlives it
        # ... a round passed on to the next hop (another range's stream, a pinned stage's, the tail's), ...
        ("XADD", f"{PREFIX}:stage:3-5:requests", "NOMKSTREAM", "MAXLEN", "~", "10000", "*", "a", "b"),
        ("XADD", f"{PREFIX}:stage:s2:requests", "NOMKSTREAM", "MAXLEN", "~", "10000", "*", "a", "b"),
        ("XADD", T, "NOMKSTREAM", "MAXLEN", "~", "10000", "*", "a", "b"),
        ("XADD", f"{PREFIX}:tail:t1:requests", "NOMKSTREAM", "MAXLEN", "~", "10000", "*", "a", "b"),
        # ... error replies, dead letters, heads' liveness and its range announced
        ("XADD", f"{PREFIX}:reply:head.h1.b", "NOMKSTREAM", "MAXLEN", "~", "10000", "*", "a", "b"),
        ("XADD", f"{PREFIX}:dead-letters", "MAXLEN", "~", "100", "*", "a", "b"),
        ("MGET", f"{PREFIX}:head:h1", f"{PREFIX}:head:h2"),
        ("ZADD", f"{PREFIX}:stages", "1700000000.5", "s1 1:3"),
        ("ZREMRANGEBYSCORE", f"{PREFIX}:stages", "-inf", "1700000000.5"),
    ],
}


def _named(cmds: list[tuple[str, ...]], renames: dict[str, str]) -> list[tuple[str, ...]]:
    """The same commands with key names of a shared role's examples turned into a named worker's own."""
    out = []
    for cmd in cmds:
        if f"{PREFIX}:reply:s" in cmd:  # a session's own reply stream: named heads read only their head stream
            continue
        args = list(cmd)
        for old, new in renames.items():
            args = [a.replace(old, new) for a in args]
        out.append(tuple(args))
    return out


for _name in NAMED_HEADS:  # a named head needs what a head does, on its own key and reply streams
    ROLE_NEEDS[f"head-{_name}"] = _named(
        ROLE_NEEDS["head"], {f"{PREFIX}:head:h1": f"{PREFIX}:head:{_name}", "reply:head.h1.": f"reply:head.{_name}."}
    )
for _name in NAMED_TAILS:  # a named tail: the shared request stream and its own
    ROLE_NEEDS[f"tail-{_name}"] = _named(ROLE_NEEDS["tail"], {f"{PREFIX}:tail:t1:": f"{PREFIX}:tail:{_name}:"})
for _name in NAMED_STAGES:  # a named stage: the ranges' shared streams and its own
    ROLE_NEEDS[f"stage-{_name}"] = _named(ROLE_NEEDS["stage"], {f"{PREFIX}:stage:s1:": f"{PREFIX}:stage:{_name}:"})


def _dryrun(s: Secured, role: str, *cmd: str) -> str:
    """ACL DRYRUN (as admin): "OK" if `role`'s user may send `cmd`, else Redis's reason; runs nothing."""
    out = s.client("admin").execute_command("ACL", "DRYRUN", role, *cmd)
    return out.decode() if isinstance(out, bytes) else str(out)
