"""What tests need to speak the relay protocol as a head would: a head identity, a session key, sealed
rounds (schemas/packets.py), for a tail that checks its heads the head's liveness key, and the head's reply stream
(made as its beacon makes it: tails never make one) with the replies read back from it by session."""

from __future__ import annotations

import time

import redis
import torch

from schemas.groups import entry_parts
from schemas.keys import Keys
from schemas.macs import seal, session_key
from schemas.packets import MAC, HeadRef, encode_round
from schemas.peek import peek_session
from schemas.requests import SamplingParams

TEST_HEAD = HeadRef(name="test-head", boot="0123456789abcdef", reply_timeout_s=15.0)
TEST_KEY = bytes(range(32))
TEST_REPLY_TO = Keys.head_reply_to(TEST_HEAD.name, TEST_HEAD.boot)


def sealed_round(header: dict, tensors: dict[str, torch.Tensor], key: bytes = TEST_KEY) -> dict[bytes, bytes]:
    """The stream fields of a round (`header` without `head` gets TEST_HEAD, without `reply_to` TEST_REPLY_TO),
    sealed with `key`."""
    return encode_round({"head": TEST_HEAD, "reply_to": TEST_REPLY_TO, **header}, tensors, key)[1]


def open_replies(r: redis.Redis, names: Keys, reply_to: str = TEST_REPLY_TO) -> str:
    """Make a head's reply stream, as its beacon does (a tail only appends to one that is there); its key."""
    stream = names.reply(reply_to)
    try:
        r.xgroup_create(stream, "test", id="0", mkstream=True)
    except redis.ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise
    return stream


def replies(r: redis.Redis, stream: str, sids: set[str], timeout_s: float = 30.0) -> dict[str, dict]:
    """The replies on a head's reply stream (a group entry unpacked), the first of each session: read until each of
    `sids` has one, or the timeout (then those that came)."""
    got: dict[str, dict] = {}
    last, deadline = "0-0", time.monotonic() + timeout_s
    while not sids <= got.keys() and time.monotonic() < deadline:
        for _, entries in r.xread({stream: last}, block=200) or []:
            for entry_id, fields in entries:
                last = entry_id
                for part in entry_parts(fields, max_bytes=64 << 20):
                    sid = peek_session(part)[0]
                    if sid is not None:
                        got.setdefault(sid, part)
    return got


def reseal(fields: dict[bytes, bytes], key: bytes = TEST_KEY) -> dict[bytes, bytes]:
    """The fields (changed after sealing) sealed again: a packet of the session's own head, however odd."""
    return seal(key, {k: v for k, v in fields.items() if k != MAC})


def announce(r: redis.Redis, names: Keys, head: HeadRef = TEST_HEAD, ttl_s: float = 600.0) -> None:
    """Set the head's liveness key as a running head does (workers/head/beacon.py)."""
    r.set(names.head(head.name), head.boot, px=int(ttl_s * 1000))


def opening_round(sid: str, head: HeadRef, hidden_size: int, max_new: int = 8) -> dict[bytes, bytes]:
    """A round that opens session `sid` for `head` (3 prompt rows of random hidden states, no drafts), signed with a
    fresh key of its own, as any writer of the request streams may send one."""
    header = dict(
        session_id=sid,
        head=head,
        reply_to=Keys.head_reply_to(head.name, head.boot),
        round_id=0,
        start_pos=0,
        input_ids=[5, 6, 7],
        draft_ids=[],
        sampling=SamplingParams(),
        eos_token_ids=[],
        max_new=max_new,
        q_kind="none",
    )
    return encode_round(header, {"hidden": torch.randn(3, hidden_size)}, session_key())[1]
