"""Bad packets get clear errors (logged and dead-lettered; a session's own head, whose packets carry its MAC,
also gets the error as a reply); the tail keeps serving others."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from schemas.dead_letters import DeadLetterRecord
from schemas.errors import PacketError
from schemas.macs import authentic, seal
from schemas.packets import (
    HEADER,
    MAC,
    TENSOR_PREFIX,
    decode_tail_message,
    encode_round,
    round_fields,
)
from schemas.packets import round_header as make_header
from schemas.requests import DraftSettings, GenerationRequest, SamplingParams
from schemas.tensors import TensorMeta
from tests.conftest import PROMPTS
from tests.relay_util import TEST_HEAD, TEST_KEY, TEST_REPLY_TO, open_replies, replies, reseal, sealed_round
from workers.head.runtime import HeadRuntime, generate

CAP = 200_000


def round_header(sid: str, **over) -> dict:
    base = dict(
        session_id=sid,
        round_id=0,
        start_pos=0,
        input_ids=[1, 2, 3],
        draft_ids=[],
        sampling=SamplingParams(),
        eos_token_ids=[0],
        max_new=4,
        q_kind="none",
    )
    return {**base, **over}


def good_fields(sid: str, hidden_size: int = 64, n: int = 3, **over) -> dict:
    over.setdefault("input_ids", [1 + i % 9 for i in range(n - len(over.get("draft_ids", [])))])
    return sealed_round(round_header(sid, **over), {"hidden": torch.randn(n, hidden_size)})


def bad_packets() -> list[tuple[str | None, dict, str, bool]]:
    """(session it names, stream fields, expected error fragment, whether its session gets a reply): a packet
    its MAC vouches for (sealed by the session's head, however odd) is answered; one that cannot be checked
    (a header that does not parse) or does not verify is only dead-lettered, except a round for a session the
    tail does not hold (answered unsigned, echoing its MAC) and another protocol version (answered unsigned:
    a head of that version logs why)."""
    trunc = good_fields("trunc")
    trunc[b"t.hidden"] = trunc[b"t.hidden"][:-5]
    trunc = reseal(trunc)
    wrong_v = good_fields("wrongv")
    wrong_v[HEADER] = json.dumps({**json.loads(wrong_v[HEADER]), "v": 99}).encode()
    no_v = good_fields("nov")
    no_v[HEADER] = json.dumps({k: v for k, v in json.loads(no_v[HEADER]).items() if k != "v"}).encode()
    extra = good_fields("extra")
    extra[HEADER] = json.dumps({**json.loads(extra[HEADER]), "surprise": 1}).encode()
    dense = good_fields("sparseq", draft_ids=[5], sampling=SamplingParams(temperature=1.0), q_kind="point", n=4)
    dense[HEADER] = json.dumps({**json.loads(dense[HEADER]), "q_kind": "sparse"}).encode()
    bad_idx = sealed_round(
        round_header("badidx", draft_ids=[5], sampling=SamplingParams(temperature=1.0), q_kind="sparse"),
        {"hidden": torch.randn(4, 64), "q_idx": torch.tensor([[999999]], dtype=torch.int32), "q_val": torch.ones(1, 1)},
    )
    forged = good_fields("forged")
    forged[b"t.hidden"] = torch.randn(3, 64).numpy().tobytes()
    badtype = reseal({HEADER: good_fields("badtype")[HEADER], b"t.hidden": b"\x00" * 100})
    return [
        (None, {b"x": b"1"}, "", False),
        (None, {HEADER: b"{not json"}, "", False),
        ("trunc", trunc, "truncated", True),
        ("wrongv", wrong_v, "unsupported packet version 99", True),
        ("nov", no_v, "unsupported packet version None", False),  # no default version taken; none to answer in
        ("extra", extra, "Extra inputs are not permitted", False),
        ("big", good_fields("big", n=CAP // 256 + 10), "exceeds the cap", True),  # its MAC verifies: answered
        ("ghost", good_fields("ghost", round_id=3, start_pos=7), "unknown session ghost", True),
        ("narrow", good_fields("narrow", hidden_size=32), "hidden states must be", True),
        ("sparseq", dense, "needs 2 q tensors", False),
        ("badidx", bad_idx, "outside the vocabulary", True),
        ("badtype", badtype, "needs 768 bytes, got 100", True),
        ("forged", forged, "MAC of a packet for session forged does not verify", False),
    ]


@pytest.fixture(scope="module")
def guarded_tail(models, tails):
    ms = models["qwen2"]
    names = tails.get(ms.target, 2, ms.n_layers, ("--max-packet-bytes", str(CAP)))
    log = tails.logdir / f"{names.prefix}.log"
    return ms, names, log


def test_bad_packets_get_clear_errors_while_others_run(guarded_tail, redis_client, hf_models, tokenizers):
    ms, names, log = guarded_tail
    runtime = HeadRuntime.load(ms.target, (0, 2), draft=ms.drafter)
    tok, hf = tokenizers["qwen2"], hf_models["qwen2"]
    results: dict[str, list[int]] = {}

    def real_generations() -> None:
        for p in PROMPTS[:6]:
            req = GenerationRequest(prompt=p, max_new_tokens=16, chat_template=False, draft=DraftSettings(k=4))
            results[p] = generate(req, runtime, redis_client, names=names).token_ids

    packets = bad_packets()
    stream = open_replies(redis_client, names)  # the test head's reply stream, where answered packets' replies go
    worker = threading.Thread(target=real_generations)
    worker.start()
    for _ in range(3):
        for _, fields, _, _ in packets:
            redis_client.xadd(names.shared_requests, fields, maxlen=1000, approximate=True)
    worker.join(120)
    assert not worker.is_alive()

    dead = [DeadLetterRecord.model_validate_json(f[HEADER]) for _, f in redis_client.xrange(names.dead_letters)]
    expected = bad_packets()
    answered = {sid for sid, _, _, yes in expected if sid is not None and yes}
    got = replies(redis_client, stream, answered)
    for sid, _, fragment, yes in expected:
        if sid is None:
            continue
        assert any(d.session_id == sid and fragment in d.reason for d in dead), (sid, fragment)
        if yes:
            reply = decode_tail_message(got[sid])
            assert reply.kind == "error" and fragment in reply.error, (sid, reply)
        else:
            assert sid not in got, sid
    for p in PROMPTS[:6]:
        ids = torch.tensor([tok.encode(p)])
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16)
        assert results[p] == want[0, ids.shape[1] :].tolist()
    text = log.read_text()
    assert text.count("bad packet") >= 3 * len(bad_packets())
    assert "packet has no header" in text and "header is not JSON" in text


def test_a_header_made_ahead_seals_the_same_round():
    """`round_header` before the tensors exist, then `round_fields`: the same stream fields as `encode_round`; a
    tensor that is not what the header says is refused rather than sealed under it."""
    fields = {"head": TEST_HEAD, "reply_to": TEST_REPLY_TO, **round_header("s" * 32, start_pos=5, draft_ids=[4, 5])}
    hidden = torch.randn(5, 8, dtype=torch.float16)
    packet, header = make_header(fields, {"hidden": TensorMeta(dtype="float16", shape=[5, 8])}, TEST_KEY)
    assert (
        seal(TEST_KEY, round_fields(packet, header, {"hidden": hidden}))
        == encode_round(fields, {"hidden": hidden}, TEST_KEY)[1]
    )
    for other in (hidden.float(), torch.randn(4, 8, dtype=torch.float16)):
        with pytest.raises(PacketError, match="its header says otherwise"):
            round_fields(packet, header, {"hidden": other})
    with pytest.raises(PacketError, match="not the header's"):
        round_fields(packet, header, {"hidden": hidden, "q": hidden})


@pytest.mark.parametrize("size", [100, 64 * 1024 + 5])
def test_a_mac_over_a_view_is_the_mac_over_its_bytes(size):
    """A tail checks rounds whose tensors are views of a group entry's bytes, and a head sends large fields as views
    (workers/head/sealing.py): the MAC is the same either way, and a changed byte is caught."""
    body = bytes(range(256)) * (size // 256) + bytes(size % 256)
    fields = seal(TEST_KEY, {HEADER: b'{"v":3}', TENSOR_PREFIX + b"hidden": body})
    assert authentic(TEST_KEY, fields)
    assert authentic(TEST_KEY, {**fields, TENSOR_PREFIX + b"hidden": memoryview(body)})
    forged = bytearray(body)
    forged[-1] ^= 1
    assert not authentic(TEST_KEY, {**fields, TENSOR_PREFIX + b"hidden": bytes(forged)})
    assert fields[MAC] != seal(TEST_KEY, {HEADER: b'{"v":3}', TENSOR_PREFIX + b"hidden": bytes(forged)})[MAC]
