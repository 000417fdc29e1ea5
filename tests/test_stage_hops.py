"""Each middle stage's time with a round on the wire (schemas/packets.py `hop_ms`): one per hop, finite, non-negative
and bounded, in a round and in its verdict alike, and part of what the round's MAC covers. Process-level: the greedy
test in tests/test_stages.py reads them back from a result (`timings.hop_ms`)."""

from __future__ import annotations

import pytest
import torch

from schemas.errors import PacketError
from schemas.macs import authentic
from schemas.packets import HEADER, MAX_HOP_MS, RoundPacket, Verdict, decode_head_header, decode_tail_message
from schemas.requests import RoundTimings, SamplingParams
from tests.relay_util import TEST_KEY, reseal, sealed_round


def _round(**over) -> dict:
    header = dict(session_id="s" * 24, round_id=0, start_pos=0, input_ids=[1, 2, 3], draft_ids=[],
                  sampling=SamplingParams(), eos_token_ids=[0], max_new=4, q_kind="none", route=["tail"])  # fmt: skip
    return sealed_round(header | over, {"hidden": torch.randn(3, 8)})


def _verdict(**over) -> Verdict:
    return Verdict(session_id="s" * 24, round_id=0, accepted=0, tokens=[4], next_token=4, **over)


def test_hop_times_travel_one_per_hop_in_rounds_and_verdicts():
    fields = _round(hops=["st1", "st2"], hop_ms=[1.5, 0.0])
    got = decode_head_header(fields)
    assert isinstance(got, RoundPacket) and got.hop_ms == [1.5, 0.0]
    assert decode_head_header(_round()).hop_ms == []  # a head's round: no hop yet
    assert _verdict(hops=["st1"], hop_ms=[MAX_HOP_MS]).hop_ms == [MAX_HOP_MS]
    assert RoundTimings().hop_ms == [] and "hop_ms" in RoundTimings().model_dump()  # two workers: none


@pytest.mark.parametrize(
    ("hops", "hop_ms", "why"),
    [
        (["st1"], [], "one time per hop"),
        ([], [1.0], "one time per hop"),
        (["st1"], [-1.0], "greater than or equal to 0"),
        (["st1"], [MAX_HOP_MS * 2], "less than or equal to"),
        (["st1"], [float("nan")], "finite number"),
        (["st1"], [float("inf")], "finite number"),
    ],
)
def test_hop_times_that_do_not_fit_are_refused(hops, hop_ms, why):
    with pytest.raises(ValueError, match=why):
        _verdict(hops=hops, hop_ms=hop_ms)
    with pytest.raises(ValueError, match=why):
        _round(hops=hops, hop_ms=hop_ms)


def test_a_non_finite_hop_time_in_json_is_refused():
    """JSON as a writer of the streams may send it (NaN and Infinity parse in Python's json, not in a model)."""
    fields = _round(hops=["st1"], hop_ms=[2.0])
    head = fields[HEADER].replace(b'"hop_ms":[2.0]', b'"hop_ms":[NaN]')
    with pytest.raises(PacketError, match="hop_ms"):
        decode_head_header(reseal({**fields, HEADER: head}))
    reply = {HEADER: _verdict(hops=["st1"], hop_ms=[2.0]).model_dump_json().encode().replace(b"2.0", b"Infinity")}
    with pytest.raises(PacketError, match="hop_ms"):
        decode_tail_message(reply)


def test_the_mac_covers_the_hop_times():
    fields = _round(hops=["st1"], hop_ms=[2.0])
    assert authentic(TEST_KEY, fields)
    changed = {**fields, HEADER: fields[HEADER].replace(b'"hop_ms":[2.0]', b'"hop_ms":[0.5]')}
    assert changed[HEADER] != fields[HEADER] and not authentic(TEST_KEY, changed)
