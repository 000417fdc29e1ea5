"""Relay plumbing: embedded Redis (TCP and unix socket), URLs with ACL users, transport retries."""

from __future__ import annotations

import uuid

import pytest
import redis

from relay_broker.connection import connect, transport_retry, warm_pool
from relay_broker.embedded import EmbeddedRedis, free_port
from relay_broker.streams import GroupReader, Reply
from schemas.errors import TransportError
from schemas.keys import Keys
from schemas.settings import Settings


def test_embedded_unix_socket_and_clean_stop():
    server = EmbeddedRedis(unix_socket=True).start()
    path = server.socket_path
    assert connect(server.url).ping()
    server.stop()
    assert not path.exists()
    with pytest.raises(TransportError):
        connect(f"unix://{path}", socket_connect_timeout=0.2, attempts=2)


def test_acl_user_and_password(redis_server):
    admin = connect(redis_server.url)
    admin.acl_setuser("sf-head", enabled=True, passwords=["+s3cret"], keys=["shardflow:*"], commands=["+@all"])
    try:
        url = redis_server.url.replace("redis://", "redis://sf-head:s3cret@")
        assert connect(url).set("shardflow:acl-check", 1)
        assert connect(redis_server.url, username="sf-head", password="s3cret").get("shardflow:acl-check") == b"1"
        with pytest.raises(TransportError, match="credentials"):
            connect(redis_server.url, username="sf-head", password="wrong")
        with pytest.raises(redis.ResponseError, match="no permissions"):
            connect(url).set("elsewhere", 1)
    finally:
        admin.acl_deluser("sf-head")


def test_transport_errors_retried_job_errors_not():
    calls = {"net": 0, "bug": 0}

    @transport_retry(attempts=3)
    def net() -> None:
        calls["net"] += 1
        raise redis.ConnectionError("down")

    @transport_retry(attempts=3)
    def bug() -> None:
        calls["bug"] += 1
        raise ValueError("not a transport problem")

    with pytest.raises(TransportError, match="after 3 attempts"):
        net()
    with pytest.raises(ValueError):
        bug()
    assert calls == {"net": 3, "bug": 1}


def test_unreachable_redis_is_a_transport_error():
    with pytest.raises(TransportError):
        connect(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=0.2, attempts=2)
    with pytest.raises(TransportError, match="bad Redis URL"):
        connect("http://nope")


def test_group_reader_pending_first_then_new(redis_client):
    names = Keys("relaytest")
    reader = GroupReader(redis_client, names.tail_group, "c1", [names.shared_requests])
    redis_client.xadd(names.shared_requests, {b"h": b"1"})
    ((stream, entry_id, fields),) = reader.read(block_ms=100)
    assert fields == {b"h": b"1"}
    again = GroupReader(redis_client, names.tail_group, "c1", [names.shared_requests])  # a restart
    assert [e[1] for e in again.read(block_ms=100)] == [entry_id]  # unacked entry comes back first
    again.ack(stream, entry_id)
    assert redis_client.xlen(names.shared_requests) == 0
    assert again.read(block_ms=50) == []


def test_a_reply_never_makes_a_stream_and_a_refused_one_fails_no_ack(redis_client, caplog):
    """Issue 56, N2: one XADD of the last possible id froze a head: every later reply to it failed on every tail
    (the tail's whole acknowledgement failed with it). A tail's replies never make a head's stream (one that is
    gone drops them), and a write Redis refuses is logged once while the entries are acknowledged all the same."""
    names = Keys(f"replytest-{uuid.uuid4().hex[:6]}")
    reader = GroupReader(redis_client, names.tail_group, "c1", [names.shared_requests])
    gone, wedged = names.reply("head.h.gone"), names.reply("head.h.wedged")
    redis_client.execute_command("XADD", wedged, "18446744073709551615-18446744073709551615", "junk", "1")
    for _ in range(2):
        redis_client.xadd(names.shared_requests, {b"h": b"round"})
        ((stream, entry_id, _),) = reader.read(block_ms=100)
        reader.ack_many(
            [(stream, entry_id, Reply(gone, {b"h": b"v"})), (stream, entry_id, Reply(wedged, {b"h": b"v"}))]
        )
    assert not redis_client.exists(gone) and redis_client.xlen(wedged) == 1
    assert redis_client.xlen(names.shared_requests) == 0  # both acknowledged and deleted
    assert sum("cannot write to" in r.message and wedged in r.message for r in caplog.records) == 1


def test_group_reader_claims_what_a_dead_consumer_left(redis_client):
    names = Keys("claimtest")
    dead = GroupReader(redis_client, names.tail_group, "dead", [names.shared_requests])
    redis_client.xadd(names.shared_requests, {b"h": b"stranded"})
    assert [e[2] for e in dead.read(block_ms=100)] == [{b"h": b"stranded"}]  # read, never acked: it "died"
    live = GroupReader(
        redis_client,
        names.tail_group,
        "live",
        [names.shared_requests],
        claim_streams=[names.shared_requests],
        settings=Settings(relay={"claim_idle_ms": 200}),
    )
    assert live.read(block_ms=50) == []  # not idle long enough yet
    import time

    time.sleep(0.3)
    ((stream, entry_id, fields),) = live.read(block_ms=50)
    assert fields == {b"h": b"stranded"}
    live.ack(stream, entry_id)
    assert redis_client.xpending(names.shared_requests, names.tail_group)["pending"] == 0


def test_warm_pool_opens_connections_ahead(redis_server):
    """A head opens its pool's connections at start, so a burst of jobs does not pay for new ones."""
    name = f"warm-{uuid.uuid4().hex[:8]}"  # counted by name: other tests' connections come and go meanwhile
    client = connect(redis_server.url, max_connections=8, client_name=name)
    assert warm_pool(client, 6) == 6
    assert len([c for c in client.client_list() if c.get("name") == name]) >= 6
    client.close()


def test_a_lingering_tail_polls_for_more_and_counts_a_groups_rounds(redis_client, monkeypatch):
    """`GroupReader.gather` (a CPU tail's linger) asks Redis for more without BLOCK (a blocked read times out only when
    Redis's event loop wakes: up to 100 ms at its default hz, which held 4 generations in flight 7x longer than one at a
    time), takes what comes within the linger, and counts a head's group entry as the rounds it carries."""
    from schemas.groups import pack_group

    names = Keys(f"gather-{uuid.uuid4().hex[:6]}")
    reader = GroupReader(redis_client, names.tail_group, "c1", [names.shared_requests])
    blocked = []
    read = reader.read
    monkeypatch.setattr(reader, "read", lambda *a, **k: blocked.append(k) or read(*a, **k))
    redis_client.xadd(names.shared_requests, {b"h": b"1"})
    redis_client.xadd(names.shared_requests, {b"h": b"2"})
    first = reader.read(count=1, block_ms=100)
    got = reader.gather(first, slots=8, open_sessions=4, linger_ms=5)
    assert [f for _, _, f in got] == [{b"h": b"1"}, {b"h": b"2"}] and len(blocked) == 1  # the rest polled
    group = pack_group([{b"h": b"a", b"m": bytes(32)}, {b"h": b"b", b"m": bytes(32)}, {b"h": b"c", b"m": bytes(32)}])
    redis_client.xadd(names.shared_requests, group)
    redis_client.xadd(names.shared_requests, {b"h": b"later"})
    first = reader.read(count=1, block_ms=100)
    assert len(reader.gather(first, slots=8, open_sessions=3, linger_ms=5)) == 1  # its 3 rounds: every session's
