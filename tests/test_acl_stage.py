"""The ACL's middle-stage role (issue 59; the ACL tests of the other roles: tests/test_acl.py): a stage user reaches
its own range's and its own streams, adds to the next hops' and heads' reply streams and announces itself in
`stages`, and nothing else; a real StageWorker does its whole job under it."""

from __future__ import annotations

import pytest
import redis

from tests.secure_redis import QUEUE, render_acl
from tests.test_acl import SHARED, P, _allowed, _dryruns

# --- middle stages (issue 59) ---------------------------------------------------------------------------------------
STAGE_OTHER_ROLES = [  # what a stage may only XADD to (or only read), tried with everything else a stage user has
    ("XREADGROUP", "GROUP", f"{P}:tails", "thief", "STREAMS", SHARED, ">"),
    ("XAUTOCLAIM", SHARED, f"{P}:tails", "thief", "0", "0"),
    ("XGROUP", "CREATE", SHARED, "thief", "0"),
    ("XGROUP", "DESTROY", SHARED, f"{P}:tails"),
    ("XACK", f"{P}:tail:t1:requests", f"{P}:tails", "1-0"),
    ("XDEL", f"{P}:tail:t1:requests", "1-0"),
    ("XRANGE", SHARED, "-", "+"),
    ("XREAD", "STREAMS", f"{P}:reply:head.h1.b", "0"),
    ("XREADGROUP", "GROUP", "head.b", "thief", "STREAMS", f"{P}:reply:head.h1.b", ">"),
    ("XDEL", f"{P}:reply:head.h1.b", "1-0"),
    ("XRANGE", f"{P}:dead-letters", "-", "+"),
    ("XDEL", f"{P}:dead-letters", "1-0"),
    ("SET", f"{P}:head:h1", "0badf00d"),
    ("XADD", f"{P}:tokens:j1", "*", "text", "x"),
    ("GET", f"{P}:result:j1"),
    ("GET", f"{P}:ckpt:j1"),
    ("EXISTS", f"{P}:cancel:j1"),
    ("HGETALL", "rq:job:j1"),
    ("RPUSH", f"rq:queue:{QUEUE}", "j1"),
    ("ZRANGE", f"{P}:stages", "0", "-1"),  # `stages`: ZADD and ZREMRANGEBYSCORE only
    ("ZRANGEBYSCORE", f"{P}:stages", "-inf", "+inf"),
    ("ZREM", f"{P}:stages", "s2 3:5"),
    ("ZPOPMIN", f"{P}:stages"),
    ("ZINCRBY", f"{P}:stages", "1e9", "s2 3:5"),
    ("ZREMRANGEBYRANK", f"{P}:stages", "0", "-1"),
    ("ZUNIONSTORE", f"{P}:stages", "1", f"{P}:stage:own:requests"),
    ("SUBSCRIBE", "rq:pubsub:w1"),
]


@pytest.mark.parametrize("role", ["stage", "stage-iso-s1"])
def test_a_stage_only_adds_to_other_roles_streams_and_announces_in_stages(secured, role):
    """Tails' request streams, heads' reply streams and the dead letters take a stage's XADD and nothing else from
    it; `stages` its ZADD and ZREMRANGEBYSCORE; heads' liveness keys are read only; job and RQ keys out of reach."""
    assert _allowed(secured, role, STAGE_OTHER_ROLES) == []


def test_the_stages_set_is_read_by_heads_and_written_by_stages_alone(secured):
    """Only stages announce (a head, a tail or a producer cannot add a range for heads to route through or drop
    one), only heads read the announcements, and no one but admin can DEL, EXPIRE or RENAME the set."""
    key = f"{P}:stages"
    announce = [("ZADD", key, "1e12", "evil 1:3"), ("ZREMRANGEBYSCORE", key, "-inf", "+inf"), ("ZREM", key, "x")]
    drop = [("DEL", key), ("UNLINK", key), ("EXPIRE", key, "1"), ("RENAME", key, f"{P}:stages2"), ("SET", key, "x")]
    read = [("ZRANGEBYSCORE", key, "0", "+inf"), ("ZRANGE", key, "0", "-1")]
    for role in ("producer", "tail", "tail-iso-t1", "head", "head-iso-a"):
        assert _allowed(secured, role, announce + drop + (read if not role.startswith("head") else [])) == [], role
    for role in ("head", "head-iso-a"):
        assert _dryruns(secured, role, [read[0]]) == ["OK"]
    for role in ("stage", "stage-iso-s1"):
        assert _dryruns(secured, role, announce[:2]) == ["OK", "OK"]


def test_a_named_stage_cannot_expire_or_read_another_stages_stream(secured):
    """A named stage's user reaches the ranges' shared streams (stage:A-B, never a name: names start with a letter)
    and its own, no other named stage's, and expires only its own; the shared `stage` user, like the shared `tail`,
    reaches every stage's."""
    other, shared = f"{P}:stage:iso-s2:requests", f"{P}:stage:1-3:requests"
    attacks = [
        ("EXPIRE", other, "0"),
        ("PEXPIRE", other, "0"),
        ("XREADGROUP", "GROUP", f"{P}:stage:1-3:stages", "thief", "STREAMS", other, ">"),
        ("XAUTOCLAIM", other, f"{P}:stage:1-3:stages", "thief", "0", "0"),
        ("XDEL", other, "1-0"),
        ("XACK", other, f"{P}:stage:1-3:stages", "1-0"),
        ("XGROUP", "CREATE", other, "thief", "0", "MKSTREAM"),
        ("EXPIRE", shared, "0"),
        ("XADD", f"{P}:reply:some-session", "*", "a", "b"),
    ]
    assert _allowed(secured, "stage-iso-s1", attacks) == []
    own = f"{P}:stage:iso-s1:requests"
    needs = [("EXPIRE", own, "3600"), ("XDEL", own, "1-0"), ("XAUTOCLAIM", shared, "g", "c", "0", "0")]
    assert _dryruns(secured, "stage-iso-s1", needs) == ["OK"] * 3
    assert _dryruns(secured, "stage", [("EXPIRE", other, "3600")]) == ["OK"]
    with pytest.raises(render_acl.RenderError, match="must start with a letter"):
        render_acl.render(render_acl.TEMPLATE.read_text(), {"SHARDFLOW_ACL_STAGES": "1-3"})


def _denied(admin: redis.Redis, user: str) -> list[dict]:
    """The server's ACL LOG entries of `user` (every command and key it was refused since the last reset)."""
    out = []
    for entry in admin.acl_log(count=128):
        entry = {(k.decode() if isinstance(k, bytes) else k): v for k, v in entry.items()}
        if (entry.get("username") or b"") in (user, user.encode()):
            out.append(entry)
    return out


@pytest.fixture(scope="module")
def stage_model(tmp_path_factory):
    from workers.tiny_models import build_tokenizer, save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("model") / "qwen2", "qwen2", tokenizer=build_tokenizer())


@pytest.mark.parametrize(("user", "stage_id"), [("stage", "acl-shared-s"), ("stage-iso-s1", "iso-s1")])
def test_a_stage_does_its_whole_job_under_its_own_user(secured, stage_model, user, stage_id):
    """A real StageWorker (layers 1:3 of a tiny model) logged in as a stage user, and a head's real calls under the
    head user: the head finds the stage's range (ZRANGEBYSCORE), XADDs an opening round, a forged one and one for
    the wrong layer to the range's stream and a close to the stage's own; the stage passes the round on to the tail's
    stream, dead-letters the forged one, answers the broken one on the head's reply stream, announces itself and
    keeps its stream, and Redis's ACL LOG holds no denial of the stage user or the head user."""
    import threading
    import time

    import torch

    from relay_broker.streams import publish_many
    from schemas.keys import Keys
    from schemas.macs import session_key
    from schemas.packets import HEADER, ClosePacket, HeadRef, encode_message, encode_round
    from schemas.requests import SamplingParams
    from schemas.settings import Settings
    from workers.engine.runner import Engine
    from workers.engine.shard import load_shard
    from workers.head.routes import Routes
    from workers.stage.server import StageWorker

    names, admin, head_r = Keys(P), secured.client("admin"), secured.client("head")
    layers, boot = (1, 3), "0123456789abcdef"
    head = HeadRef(name=f"acl-h-{stage_id}", boot=boot, reply_timeout_s=30)
    reply_to = Keys.head_reply_to(head.name, boot)
    own, shared = names.stage_requests(stage_id), names.stage_shared(layers)
    made = [own, shared, names.reply(reply_to), names.shared_requests, names.head(head.name), names.stages]
    admin.delete(*made, names.dead_letters)
    admin.execute_command("ACL", "LOG", "RESET")
    head_r.xgroup_create(names.reply(reply_to), "head.x", id="0", mkstream=True)  # as workers/head/beacon.py does
    head_r.set(names.head(head.name), boot, px=60_000)
    secured.client("tail").xgroup_create(names.shared_requests, names.tail_group, id="0", mkstream=True)

    shard = load_shard(stage_model, layers, embed=False, head=False, dtype=torch.float32)
    settings = Settings(redis={"block_ms": 50, "prefix": P}, relay={"head_check_s": 0.1, "claim_idle_ms": 100})
    worker = StageWorker(
        shard,
        secured.client(user),
        names=names,
        tail_id=stage_id,
        settings=settings,
        engine=Engine(shard, settings, slots=2, label="stage"),
    )
    worker.announce()
    serving = threading.Thread(target=worker.serve, daemon=True)
    serving.start()
    try:
        assert Routes(layers[0]).route(head_r, names) == ["stage:1-3", "tail"]

        def opening(sid: str, layer: int, key: bytes) -> dict:
            header = dict(
                session_id=sid, head=head, reply_to=reply_to, round_id=0, start_pos=0, input_ids=[5, 6, 7],
                draft_ids=[], sampling=SamplingParams(), eos_token_ids=[], max_new=4, q_kind="none",
                route=["tail"], layer=layer,
            )  # fmt: skip
            return encode_round(header, {"hidden": torch.randn(3, shard.config.hidden_size)}, key)[1]

        good, broken = f"acl-{stage_id}-good", f"acl-{stage_id}-broken"
        key = session_key()
        forged = {**opening(f"acl-{stage_id}-forged", 1, session_key()), b"m": bytes(32)}
        rounds = [opening(good, 1, key), forged, opening(broken, 2, session_key())]
        publish_many(head_r, [(shared, f) for f in rounds], maxlen=1000)
        deadline = time.monotonic() + 30
        while not (
            [f for _, f in admin.xrange(names.shared_requests) if good.encode() in f.get(HEADER, b"")]
            and admin.xlen(names.reply(reply_to)) >= 1
            and admin.xlen(names.dead_letters) >= 2  # the forged entry and the broken round
            and admin.ttl(own) > 0
        ):
            assert serving.is_alive() and time.monotonic() < deadline, "the stage did not serve its rounds"
            time.sleep(0.05)
        assert worker.sessions.get(good) is not None
        publish_many(head_r, [(own, encode_message(ClosePacket(session_id=good), key))], maxlen=1000)
        while worker.sessions.get(good) is not None:
            assert time.monotonic() < deadline, "the stage did not read the close on its own stream"
            time.sleep(0.05)
        time.sleep(0.3)  # a liveness check (MGET of the head keys) and an XAUTOCLAIM are due meanwhile
    finally:
        worker.stop_event.set()
        serving.join(10)
    assert [m.decode() for m in admin.zrange(names.stages, 0, -1)] == [f"{stage_id} 1:3"]
    assert admin.xlen(shared) == 0 and admin.xlen(own) == 0  # acknowledged and deleted
    assert _denied(admin, user) == [] and _denied(admin, "head") == []
    admin.delete(*made, names.dead_letters)
