"""Schemas and the tensor codec: round trips, caps, and clear validation errors."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from schemas.errors import PacketError
from schemas.macs import authentic, seal
from schemas.packets import (
    HEADER,
    MAC,
    ErrorReply,
    Verdict,
    decode_head_header,
    decode_head_message,
    decode_tail_message,
    encode_message,
)
from schemas.requests import GenerationRequest, SamplingParams
from schemas.settings import RelaySettings
from schemas.tensors import TensorMeta, decode_tensor, encode_tensor
from tests.relay_util import TEST_KEY, sealed_round
from workers.speculative.sampling import decode_q, encode_q


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32]
)
def test_tensor_round_trip(dtype):
    t = (torch.randn(3, 5) * 100).to(dtype)
    meta, raw = encode_tensor(t)
    assert meta.shape == [3, 5] and len(raw) == meta.nbytes
    assert torch.equal(decode_tensor(meta, raw), t)


def test_tensor_codec_rejects_bad_input():
    meta, raw = encode_tensor(torch.ones(4, 4))
    with pytest.raises(PacketError, match="truncated"):
        decode_tensor(meta, raw[:-1])
    with pytest.raises(PacketError, match="exceeds the cap"):
        decode_tensor(TensorMeta(dtype="float32", shape=[1 << 20, 1 << 10]), b"")
    with pytest.raises(ValidationError):
        TensorMeta(dtype="object", shape=[1])  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        TensorMeta(dtype="float32", shape=[-1])
    with pytest.raises(PacketError, match="allow-list"):
        encode_tensor(torch.ones(2, dtype=torch.complex64))


def header(**over):
    base = dict(
        session_id="s1",
        round_id=0,
        start_pos=0,
        input_ids=[1, 2],
        draft_ids=[3],
        sampling=SamplingParams(),
        eos_token_ids=[0],
        max_new=5,
        q_kind="none",
    )
    return {**base, **over}


def test_round_packet_round_trip():
    q = torch.zeros(1, 50)
    q[0, 3], q[0, 7] = 0.75, 0.25
    kind, qt = encode_q(q)
    assert kind == "sparse"
    fields = sealed_round(
        header(sampling=SamplingParams(temperature=1.0), q_kind=kind), {"hidden": torch.randn(3, 8), **qt}
    )
    msg, tensors = decode_head_message(fields)
    assert msg.draft_ids == [3] and tensors["hidden"].shape == (3, 8)
    assert torch.equal(decode_q(kind, torch.tensor([3]), tensors, 50), q)
    assert encode_q(torch.full((2, 4), 0.25))[0] == "dense"


@pytest.mark.parametrize(
    ("over", "msg"),
    [
        (dict(q_kind="point"), "does not fit"),
        (dict(sampling=SamplingParams(temperature=1.0)), "does not fit"),
        (dict(session_id="no spaces allowed"), "pattern"),
        (dict(input_ids=[]), "at least 1"),
        (dict(input_ids=[1, 2, 3]), "must be \\[4, hidden_size\\]"),
        (dict(prefill_more=7), "carries no drafts"),  # a part of a prompt drafts nothing
        (dict(input_ids=[1, 2, 3], draft_ids=[], prefill_more=7, replay=True), "is no replay"),
        (dict(input_ids=[1], draft_ids=[4, 5], replay=True), "at least two committed tokens"),
    ],
)
def test_round_packet_validation(over, msg):
    with pytest.raises(ValidationError, match=msg):
        sealed_round(header(**over), {"hidden": torch.randn(3, 8)})


def test_a_part_of_a_prompt_and_a_replay_past_position_0_are_rounds():
    """A part of a long prompt (rows cached, nothing committed) and the replay that ends a replay in parts."""
    from workers.head.verdicts import verdict_problem

    part, _ = decode_head_message(sealed_round(header(draft_ids=[], prefill_more=9), {"hidden": torch.randn(2, 8)}))
    assert part.prefill_more == 9
    last = header(start_pos=40, input_ids=[1, 2, 3], replay=True)
    assert decode_head_message(sealed_round(last, {"hidden": torch.randn(4, 8)}))[0].replay
    empty = Verdict(session_id="s1", round_id=0, accepted=0, tokens=[], next_token=None)
    assert verdict_problem(empty, [], 5, 50, part=True) is None
    assert verdict_problem(empty, [], 5, 50) is not None  # a round that is no part commits something
    some = Verdict(session_id="s1", round_id=0, accepted=0, tokens=[4], next_token=4)
    assert "commits something" in (verdict_problem(some, [], 5, 50, part=True) or "")


def test_packet_fields_must_match_header():
    fields = sealed_round(header(), {"hidden": torch.randn(3, 8)})
    fields[b"t.extra"] = b"123"
    with pytest.raises(PacketError, match="do not match"):
        decode_head_message(fields)
    with pytest.raises(PacketError, match="exceeds the cap"):
        decode_head_message(fields, caps=RelaySettings(max_packet_bytes=50))


def test_rounds_and_replies_are_sealed_with_the_session_key():
    """Every relay message carries an HMAC-SHA256 of its header and tensors under its session's key: any
    changed byte, another key, or a reply passed off as a round (or the reverse) fails the check; only a round
    that opens a session (start_pos 0) carries the key."""
    opening = sealed_round(header(), {"hidden": torch.randn(3, 8)})
    assert authentic(TEST_KEY, opening) and decode_head_header(opening).key == TEST_KEY.hex()
    later = sealed_round(header(start_pos=5, round_id=1), {"hidden": torch.randn(3, 8)})
    assert authentic(TEST_KEY, later) and decode_head_header(later).key is None
    assert not authentic(bytes(32), later)
    for name in (HEADER, b"t.hidden"):
        changed = dict(later)
        changed[name] = bytes([changed[name][0] ^ 1]) + changed[name][1:]
        assert not authentic(TEST_KEY, changed), name
    assert not authentic(TEST_KEY, {k: v for k, v in later.items() if k != MAC})
    assert not authentic(TEST_KEY, {**later, MAC: b"short"})
    v = Verdict(session_id="s", round_id=2, accepted=1, tokens=[4, 5], next_token=5)
    reply = encode_message(v, TEST_KEY)
    assert authentic(TEST_KEY, reply, reply=True) and not authentic(TEST_KEY, reply)
    assert not authentic(TEST_KEY, seal(TEST_KEY, {HEADER: reply[HEADER]}), reply=True)  # a round's MAC on a reply


def test_an_echoed_error_can_only_ask_for_a_replay():
    echo = "ab" * 32
    assert ErrorReply(session_id="s", round_id=1, error="lost", retryable=True, echo=echo).echo == echo
    for bad in (dict(non_finite=True), dict(busy=True), dict(retryable=False)):
        with pytest.raises(ValidationError, match="only ask for a replay"):
            ErrorReply(session_id="s", round_id=1, error="x", echo=echo, **{"retryable": True, **bad})


def test_tail_message_round_trip_and_errors():
    v = Verdict(session_id="s", round_id=2, accepted=1, tokens=[4, 5], next_token=5)
    assert decode_tail_message(encode_message(v)) == v
    with pytest.raises(PacketError, match="version"):
        decode_tail_message({HEADER: b'{"v": 1, "kind": "verdict"}'})


@pytest.mark.parametrize(
    ("kw", "msg"),
    [
        (dict(prompt="  "), "prompt is empty"),
        (dict(prompt="a", messages=[{"role": "user", "content": "b"}]), "exactly one"),
        (dict(prompt="a", max_new_tokens=0), "greater than or equal to 1"),
        (dict(prompt="a", sampling={"temperature": -1}), "greater than or equal to 0"),
        (dict(prompt="a", sampling={"top_p": 0}), "greater than 0"),
        (dict(prompt="a", sampling={"top_p": 1.5}), "less than or equal to 1"),
        (dict(prompt="a", stop=[""]), "at least 1 character"),
        (dict(prompt="a", unknown=1), "Extra inputs"),
    ],
)
def test_request_validation(kw, msg):
    with pytest.raises(ValidationError, match=msg):
        GenerationRequest(**kw)
