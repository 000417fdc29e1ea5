"""Group messages (schemas/groups.py): one entry holds a group's rounds; each part comes back as its head sealed
it, its MAC verifying over its header and its binding to the group's tensors, and over nothing else; a malformed
container is refused whole; a garbage session inside a valid group fails that session alone (a real tail
process)."""

from __future__ import annotations

import json
import secrets

import pytest
import torch

from schemas.dead_letters import DeadLetterRecord
from schemas.errors import PacketError
from schemas.groups import GROUP, entry_parts, pack_group, part_mac, seal_group, unpack_group
from schemas.macs import DIGEST, authentic, session_key
from schemas.packets import HEADER, MAC, ErrorReply, Verdict, decode_tail_message
from schemas.requests import SamplingParams
from tests.relay_util import TEST_HEAD, announce, open_replies, replies, sealed_round


def _round(sid: str, n: int = 3, hidden: int = 64, key: bytes | None = None, **over) -> dict:
    header = dict(
        session_id=sid,
        round_id=0,
        start_pos=0,
        input_ids=[5 + i for i in range(n)],
        draft_ids=[],
        sampling=SamplingParams(),
        eos_token_ids=[0],
        max_new=4,
        q_kind="none",
        **over,
    )
    return sealed_round(header, {"hidden": torch.randn(n, hidden)}, key or session_key())


def _unsealed(sid: str, key: bytes, **kw) -> tuple[bytes, dict]:
    return key, {k: v for k, v in _round(sid, key=key, **kw).items() if k != MAC}


def test_parts_come_back_exactly_as_sealed():
    rounds = [_unsealed(f"g{i}", session_key(), n=2 + i) for i in range(5)]
    packed = seal_group(rounds)
    assert set(packed) == {GROUP, HEADER, MAC, b"t.hidden"}
    assert len(packed[b"t.hidden"]) == sum(len(f[b"t.hidden"]) for _, f in rounds)  # one [sum of rows, hidden] tensor
    parts = unpack_group(packed, max_bytes=1 << 24)
    for i, ((key, fields), part) in enumerate(zip(rounds, parts, strict=True)):
        assert {k: v for k, v in part.items() if k != DIGEST} == {**fields, MAC: part_mac(packed, i)}
        assert authentic(key, part) and not authentic(rounds[i - 1][0], part)
    assert len({p[DIGEST] for p in parts}) == 5  # one digest, each part's own place in it


def test_a_group_whose_tensor_bytes_changed_verifies_no_part():
    """The parts' MACs bind the group's tensors as sealed: a byte changed anywhere in them fails every part, rows
    moved from one part to another through the index fail those two; an entry alone may not bring a binding of its
    own."""
    rounds = [_unsealed(f"t{i}", session_key()) for i in range(3)]
    packed = seal_group(rounds)
    flipped = bytearray(packed[b"t.hidden"])
    flipped[-1] ^= 1
    parts = unpack_group({**packed, b"t.hidden": bytes(flipped)}, max_bytes=1 << 24)
    assert not any(authentic(k, p) for (k, _), p in zip(rounds, parts, strict=True))
    index = json.loads(packed[GROUP])
    index["parts"][0]["t"]["hidden"] -= 256  # one row of part 0 handed to part 1
    index["parts"][1]["t"]["hidden"] += 256
    parts = unpack_group({**packed, GROUP: json.dumps(index).encode()}, max_bytes=1 << 24)
    assert [authentic(k, p) for (k, _), p in zip(rounds, parts, strict=True)] == [False, False, True]  # 2's untouched
    good = unpack_group(packed, max_bytes=1 << 24)
    assert all(authentic(k, p) for (k, _), p in zip(rounds, good, strict=True))
    stolen = {**good[0], DIGEST: bytes(good[0][DIGEST]), b"t.hidden": bytes(len(good[0][b"t.hidden"]))}
    with pytest.raises(PacketError, match="group part"):  # a part's binding on an entry alone: its tensors unchecked
        entry_parts(stolen, max_bytes=1 << 24)
    assert not authentic(rounds[0][0], stolen)  # nor does it verify, should anything hand such an entry on: only a
    assert authentic(rounds[0][0], good[0])  # binding unpacking computed binds (a `Binding`, never an entry's bytes)
    assert entry_parts(_round("alone"), max_bytes=1 << 24)[0][HEADER]


def test_a_group_without_tensors_seals_each_part_over_its_own_fields():
    keys = [session_key() for _ in range(2)]
    packed = seal_group([(k, {HEADER: f"header {i}".encode()}) for i, k in enumerate(keys)])
    parts = unpack_group(packed, max_bytes=1 << 20)
    assert all(DIGEST not in p and authentic(k, p) for k, p in zip(keys, parts, strict=True))


def test_a_parts_tensor_bytes_are_views_never_written():
    """A part's tensors' bytes are views of the group entry's (no 8 MB copy a group of 128 7B rounds), its MAC
    verifies over them, and its hidden rows decoded as a view reach the forward only through a copy."""
    from schemas.packets import decode_head_header, round_tensors
    from workers.tail.rounds import HostToDevice

    keys = [session_key() for _ in range(3)]
    packed = seal_group([_unsealed(f"v{i}", k, n=2 + i) for i, k in enumerate(keys)])
    before = bytes(packed[b"t.hidden"])
    parts = unpack_group(packed, max_bytes=1 << 24)
    assert all(isinstance(p[b"t.hidden"], memoryview) and isinstance(p[HEADER], bytes) for p in parts)
    assert all(authentic(k, p) for k, p in zip(keys, parts, strict=True))
    hs = []
    for part in parts:
        msg = decode_head_header(part)
        view = round_tensors(msg, part, views=frozenset({"hidden"}))["hidden"]
        assert torch.equal(view, round_tensors(msg, part)["hidden"])
        hs.append(view)
    for got in HostToDevice(torch.device("cpu"))(hs):
        got.add_(1.0)  # the forward's own copies
    assert packed[b"t.hidden"] == before


@pytest.mark.parametrize(
    "spoil",
    [
        lambda g: {**g, HEADER: g[HEADER][:-1]},
        lambda g: {**g, MAC: g[MAC] + b"x"},
        lambda g: {**g, b"t.hidden": g[b"t.hidden"][:-4]},
        lambda g: {**g, b"t.extra": b"1"},
        lambda g: {**g, GROUP: b"[" * 50_000},
        lambda g: {**g, GROUP: json.dumps({**json.loads(g[GROUP]), "v": 1}).encode()},
        lambda g: {**g, GROUP: json.dumps({**json.loads(g[GROUP]), "parts": []}).encode()},
    ],
)
def test_a_malformed_container_is_refused_whole(spoil):
    packed = pack_group([_round("a"), _round("b")])
    with pytest.raises(PacketError):
        unpack_group(spoil(packed), max_bytes=1 << 24)
    with pytest.raises(PacketError, match="exceeds the cap"):
        unpack_group(packed, max_bytes=100)


def test_a_garbage_session_inside_a_valid_group_fails_alone(models, tails, redis_client):
    ms = models["qwen2"]
    # a tail of its own: the sessions this test opens and leaves open slow every later round on a shared tail
    names = tails.get(ms.target, 2, ms.n_layers, ("--name", "groups-wire"))
    announce(redis_client, names, TEST_HEAD)
    keys = {f"grp-{i}-{secrets.token_hex(3)}": session_key() for i in range(4)}
    sids = list(keys)
    rounds = [_unsealed(sid, keys[sid]) for sid in sids]
    rounds[1] = (session_key(), rounds[1][1])  # sealed under another key than the one its header opens with: forged
    rounds[2] = _unsealed(sids[2], keys[sids[2]], n=3, hidden=32)  # wrong hidden size: a clear error
    group = seal_group(rounds)
    tampered = bytearray(group[b"t.hidden"])
    tampered[7] ^= 0x40  # a copy of the group with one byte changed goes first: none of its parts verifies
    stream = open_replies(redis_client, names)
    redis_client.xadd(names.shared_requests, {**group, b"t.hidden": bytes(tampered)})
    redis_client.xadd(names.shared_requests, group)
    got = replies(redis_client, stream, {sids[0], sids[2], sids[3]})
    for i in (0, 3):
        assert authentic(keys[sids[i]], got[sids[i]], reply=True)
        assert isinstance(decode_tail_message(got[sids[i]]), Verdict)
    bad = decode_tail_message(got[sids[2]])
    assert isinstance(bad, ErrorReply) and "hidden states must be" in bad.error
    assert sids[1] not in got  # forged: dead-lettered, unanswered
    records = [DeadLetterRecord.model_validate_json(f[HEADER]) for _, f in redis_client.xrange(names.dead_letters)]
    mine = [r for r in records if r.session_id in keys and "MAC" in r.reason]
    assert len(mine) == 4 + 1  # the tampered copy's four parts, the forged one


def test_a_group_larger_than_the_packet_cap_goes_in_several_entries(models, tails, redis_client, hf_models, tokenizers):
    """A head splits a group's rounds into entries under the packet cap (a tail refuses a larger one whole: at 256
    jobs of 128-token prompts the first rounds' group was 117 MB against a 64 MiB cap), and every generation
    still equals HF generate."""
    from concurrent.futures import ThreadPoolExecutor

    from schemas.groups import chunk_rounds
    from schemas.requests import GenerationRequest
    from schemas.settings import Settings
    from tests.conftest import PROMPTS
    from tests.job_env import reference
    from workers.head.runtime import HeadRuntime, generate

    assert chunk_rounds([{b"h": b"x" * 10}] * 7, 3 * 43) == [[0, 1, 2], [3, 4, 5], [6]]  # 11 bytes + a 32-byte MAC
    assert chunk_rounds([{b"h": b"x" * 100}], 3 * 43) == [[0]]  # too large alone: it goes alone
    assert chunk_rounds([{b"h": b"x"}] * 3, 0) == [[0], [1], [2]]  # cap 0: each alone
    ms, cap = models["qwen2"], 24_000
    names = tails.get(ms.target, 2, ms.n_layers, ("--max-packet-bytes", str(cap)))
    runtime = HeadRuntime.load(ms.target, (0, 2), settings=Settings(relay={"max_packet_bytes": cap}))
    prompts = PROMPTS[:12]

    def one(p: str) -> list[int]:
        req = GenerationRequest(prompt=p, max_new_tokens=6, chat_template=False)
        return generate(req, runtime, redis_client, names=names).token_ids

    with ThreadPoolExecutor(12) as pool:
        got = list(pool.map(one, prompts))
    assert got == [reference(hf_models["qwen2"], tokenizers["qwen2"], p, 6) for p in prompts]


def test_a_round_that_cannot_be_sealed_fails_its_generation_alone(
    models, tails, redis_client, hf_models, tokenizers, monkeypatch
):
    """Rounds are sealed on the head's sender threads, off the step loop: one that cannot be sealed fails its
    own generation (with why), and the rest of its group goes out and equals HF generate."""
    from concurrent.futures import ThreadPoolExecutor

    from schemas.requests import GenerationRequest
    from tests.conftest import PROMPTS
    from tests.job_env import reference
    from workers.head.generation import Generation
    from workers.head.runtime import HeadRuntime, generate
    from workers.head.sealing import Outbound

    ms = models["qwen2"]
    names = tails.get(ms.target, 2, ms.n_layers)
    runtime = HeadRuntime.load(ms.target, (0, 2))
    prompts, bad = PROMPTS[:6], PROMPTS[2]
    outbound, fields, broken = Generation.outbound, Outbound.fields, set()

    def marking(self: Generation) -> Outbound:
        out = outbound(self)
        if self.req.prompt == bad and self.rounds >= 1:
            broken.add(out.sid)
        return out

    def sealing(self: Outbound) -> dict:
        if self.sid in broken:
            raise PacketError("this round cannot be sealed")
        return fields(self)

    monkeypatch.setattr(Generation, "outbound", marking)
    monkeypatch.setattr(Outbound, "fields", sealing)

    def one(p: str) -> list[int] | str:
        req = GenerationRequest(prompt=p, max_new_tokens=6, chat_template=False)
        try:
            return generate(req, runtime, redis_client, names=names).token_ids
        except PacketError as e:
            return str(e)

    with ThreadPoolExecutor(len(prompts)) as pool:
        got = dict(zip(prompts, pool.map(one, prompts), strict=True))
    assert got.pop(bad) == "this round cannot be sealed"
    for p, ids in got.items():
        assert ids == reference(hf_models["qwen2"], tokenizers["qwen2"], p, 6), p


def test_groups_unpacked_side_by_side_come_back_in_order_a_bad_one_refused_alone():
    """A tail's batch of entries unpacked on its MAC threads (each group's tensors hashed once): the same rounds in
    the same order as on one thread, a malformed group refused alone, an entry alone passed through."""
    from workers.shares import Shares
    from workers.tail.rounds import expand_groups

    groups = [seal_group([_unsealed(f"s{g}-{i}", session_key(), n=8, hidden=4096) for i in range(4)]) for g in range(5)]
    groups[2] = {**groups[2], HEADER: groups[2][HEADER][:-1]}  # its index no longer adds up
    entries = [(b"s", f"{i}-0".encode(), g) for i, g in enumerate(groups)] + [(b"s", b"9-0", _round("alone"))]
    flat, bad = expand_groups(entries, 1 << 26, Shares(3, "test-unpack"))
    assert (flat, bad) == expand_groups(entries, 1 << 26)
    assert [b[1] for b in bad] == [b"2-0"] and len(flat) == 4 * 4 + 1
    assert [f[1] for f in flat] == [f"{g}-0".encode() for g in (0, 1, 3, 4) for _ in range(4)] + [b"9-0"]
