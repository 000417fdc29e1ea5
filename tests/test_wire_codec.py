"""The lossless wire codec (schemas/codec.py): bit-for-bit round trips, hostile streams refused as PacketError before
anything larger than the header's bytes is decompressed, MACs over the compressed bytes, the rule for when
compressing pays, and a round's rows: exactly its tokens', never a graph's padding."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
import zstandard
from pydantic import ValidationError

from schemas.codec import (
    CODECS,
    DECODE_BYTES_PER_S,
    ENCODE_BYTES_PER_S,
    MARGIN,
    RATIO,
    Codec,
    decode,
    encode,
    join_planes,
    pick_codec,
    split_planes,
    worth_compressing,
)
from schemas.errors import PacketError
from schemas.groups import seal_group, unpack_group
from schemas.keys import Keys
from schemas.macs import DIGEST, authentic, session_key
from schemas.packets import (
    HEADER,
    TENSOR_PREFIX,
    Verdict,
    decode_head_header,
    decode_tail_message,
    encode_round,
    make_round,
    round_fields,
    round_header,
    round_tensors,
)
from schemas.requests import SamplingParams
from schemas.settings import RelaySettings, Settings
from schemas.tensors import DTYPES, TensorMeta, decode_tensor, encode_tensor
from tests.relay_util import TEST_HEAD, TEST_KEY, TEST_REPLY_TO
from workers.engine.kvcache import KVCache
from workers.engine.shard import load_shard
from workers.tail.server import TailWorker

ZSTD: Codec = "zstd-planes"
FLOATS = [torch.bfloat16, torch.float16, torch.float32]
SHAPES = [[9, 576], [3, 5, 7], [1], [], [0, 576], [0]]
UINT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def special(dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """Activation-like values with NaNs of several payloads, ±inf, -0.0 and subnormals among them."""
    t = (torch.randn(shape) * 3).to(dtype)
    if t.numel() < 8:
        return t
    flat, ints = t.view(-1), t.view(-1).view(UINT[t.element_size()])
    flat[:4] = torch.tensor([float("inf"), -float("inf"), -0.0, torch.finfo(dtype).tiny / 4], dtype=dtype)
    nans = {2: [0x7FC1, -1, 0x7F81], 4: [0x7FC00001, -1, 0x7F800001]}[t.element_size()]
    if dtype == torch.float16:
        nans = [0x7E01, -1, 0x7C01]
    ints[4:7] = torch.tensor(nans, dtype=ints.dtype)
    return t


def header(sid: str = "s" * 32, n: int = 3, k: int = 0, **over) -> dict:
    return dict(
        session_id=sid,
        head=TEST_HEAD,
        reply_to=TEST_REPLY_TO,
        round_id=0,
        start_pos=0,
        input_ids=[5 + i for i in range(n - k)],
        draft_ids=[50 + i for i in range(k)],
        sampling=SamplingParams(),
        eos_token_ids=[2],
        max_new=16,
        q_kind="none",
        **over,
    )


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", SHAPES)
def test_round_trip_bit_for_bit(dtype: torch.dtype, shape: list[int]) -> None:
    t = special(dtype, shape)
    meta, sent = encode_tensor(t, ZSTD)
    assert meta.codec == ZSTD and meta.dtype == {v: k for k, v in DTYPES.items()}[dtype]
    back = decode_tensor(meta, sent)
    assert back.dtype == dtype and list(back.shape) == shape and bits(back) == bits(t)
    back[...] = 0  # its own buffer: writable, no view of the entry's bytes
    assert decode_tensor(meta, sent, view=True).shape == t.shape


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64, torch.int32, torch.uint8, torch.bool])
def test_round_trip_other_dtypes(dtype: torch.dtype) -> None:
    t = torch.randint(0, 2 if dtype == torch.bool else 200, (4, 7)).to(dtype)
    assert torch.equal(decode_tensor(*encode_tensor(t, ZSTD)), t)


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_every_bit_pattern_survives(itemsize: int) -> None:
    """Random bit patterns (every NaN payload a dtype has, in the limit): incompressible planes go as they are."""
    raw = np.random.default_rng(itemsize).integers(0, 256, 4096 * itemsize, dtype=np.uint8).tobytes()
    sent = encode(ZSTD, raw, itemsize)
    assert len(sent) == len(raw) + 4 * itemsize  # each plane stored raw beside its length
    assert bytes(decode(ZSTD, sent, len(raw), itemsize)) == raw
    assert join_planes(split_planes(raw, itemsize), itemsize).tobytes() == raw


def test_planes_most_significant_first() -> None:
    raw = struct.pack("<2H", 0x1234, 0xABCD)
    assert [p.tobytes() for p in split_planes(raw, 2)] == [b"\x12\xab", b"\x34\xcd"]


def test_activations_compress() -> None:
    """Activation-like bfloat16 rows (a 7B K = 8 round): the sign-and-exponent plane shrinks, the whole too."""
    t = (torch.randn(9, 3584) * 2).to(torch.bfloat16)
    meta, sent = encode_tensor(t, ZSTD)
    assert len(sent) < 0.8 * meta.nbytes


def test_raw_header_unchanged() -> None:
    """A raw tensor's header names no codec (what every build before codecs sent and reads); a compressed one's
    does, and its MAC'd header says so."""
    t = torch.randn(3, 8)
    _, raw_fields = encode_round(header(), {"hidden": t}, TEST_KEY)
    assert b"codec" not in raw_fields[HEADER]
    assert raw_fields[TENSOR_PREFIX + b"hidden"] == bits(t)
    assert TensorMeta.model_validate_json('{"dtype": "float32", "shape": [3, 8]}').codec == "raw"
    packet, fields = encode_round(header(), {"hidden": t}, TEST_KEY, codec=ZSTD)
    assert b'"codec":"zstd-planes"' in fields[HEADER] and packet.tensors["hidden"].codec == ZSTD
    assert encode_round(header(), {"hidden": t}, TEST_KEY, codec="raw")[1] == raw_fields


def test_round_fields_follow_the_header() -> None:
    """The head's split path (header first, tensors after) encodes each tensor under its header's codec."""
    t = torch.randn(3, 8).to(torch.bfloat16)
    metas = {"hidden": TensorMeta(dtype="bfloat16", shape=[3, 8], codec=ZSTD)}
    packet, head = round_header(header(), metas, TEST_KEY)
    assert round_fields(packet, head, {"hidden": t}) == make_round(header(), {"hidden": t}, TEST_KEY, codec=ZSTD)[1]


def sealed(codec: Codec = ZSTD, rows: int = 9, width: int = 64) -> tuple[dict, torch.Tensor]:
    t = (torch.randn(rows, width) * 2).to(torch.bfloat16)
    return encode_round(header(n=rows), {"hidden": t}, TEST_KEY, codec=codec)[1], t


def test_tail_path_decodes_authentic_round() -> None:
    fields, t = sealed()
    msg = decode_head_header(fields)  # the header alone: no tensor decoded before the MAC is checked
    assert authentic(TEST_KEY, fields)
    assert bits(round_tensors(msg, fields, views=frozenset({"hidden"}))["hidden"]) == bits(t)


def test_mac_covers_compressed_bytes() -> None:
    fields, _ = sealed()
    name = TENSOR_PREFIX + b"hidden"
    for i in (0, 4, len(fields[name]) // 2, len(fields[name]) - 1):  # the plane table, a frame, the stored plane
        forged = dict(fields)
        forged[name] = fields[name][:i] + bytes([fields[name][i] ^ 1]) + fields[name][i + 1 :]
        assert not authentic(TEST_KEY, forged)
    renamed = dict(fields)  # the codec it names is MAC'd with the header
    renamed[HEADER] = fields[HEADER].replace(b'"codec":"zstd-planes"', b'"codec":"raw"')
    assert renamed[HEADER] != fields[HEADER] and not authentic(TEST_KEY, renamed)


def test_group_binding_covers_compressed_bytes() -> None:
    """In a group entry (one compressed round, one raw), each part's MAC binds the group's bytes as sent."""
    hidden = {"a" * 32: torch.randn(9, 64).to(torch.bfloat16), "b" * 32: torch.randn(5, 64)}
    codecs: list[Codec] = [ZSTD, "raw"]
    rounds = [
        (TEST_KEY, make_round(header(sid=sid, n=len(t)), {"hidden": t}, TEST_KEY, codec=codec)[1])
        for (sid, t), codec in zip(hidden.items(), codecs, strict=True)
    ]
    entry = seal_group(rounds)
    parts = unpack_group(entry, max_bytes=1 << 24)
    assert all(DIGEST in p and authentic(TEST_KEY, p) for p in parts)
    for p, t in zip(parts, hidden.values(), strict=True):
        assert bits(round_tensors(decode_head_header(p), p, views=frozenset({"hidden"}))["hidden"]) == bits(t)
    name = TENSOR_PREFIX + b"hidden"
    forged = {**entry, name: entry[name][:10] + bytes([entry[name][10] ^ 1]) + entry[name][11:]}
    assert not any(authentic(TEST_KEY, p) for p in unpack_group(forged, max_bytes=1 << 24))


def planes_stream(*stored: bytes) -> bytes:
    return b"".join(len(s).to_bytes(4, "little") for s in stored) + b"".join(stored)


def test_hostile_streams_are_packet_errors() -> None:
    n = 64  # elements: two planes of 64 bytes for a 2-byte dtype
    good = encode(ZSTD, (torch.randn(n) * 2).to(torch.bfloat16).view(torch.uint8).numpy(), 2)
    assert len(decode(ZSTD, good, 2 * n, 2)) == 2 * n
    zeros = zstandard.ZstdCompressor(level=1)
    cases = {
        "truncated table": good[:5],
        "truncated stream": good[:-3],
        "one byte more": good + b"\0",
        "plane longer than the tensor": planes_stream(bytes(n + 1), bytes(n - 1)),
        "a bomb: frame stating more than the plane": planes_stream(zeros.compress(bytes(1 << 20)), bytes(n)),
        "frame stating fewer bytes": planes_stream(zeros.compress(bytes(n // 2)), bytes(n)),
        "frame stating no size": planes_stream(
            zstandard.ZstdCompressor(level=1, write_content_size=False).compress(bytes(n)), bytes(n)
        ),
        "two frames in one plane": planes_stream(zeros.compress(bytes(n)) * 2, bytes(n)),
        "frame then junk": planes_stream(zeros.compress(bytes(n)) + b"junk", bytes(n)),
        "not a frame": planes_stream(b"\x28\xb5\x2f\xfd" + bytes(8), bytes(n)),
        "frame cut short": planes_stream(zeros.compress(bytes(n))[:-2], bytes(n)),
    }
    for why, stream in cases.items():
        with pytest.raises(PacketError):
            decode(ZSTD, stream, 2 * n, 2)
            pytest.fail(why)
    with pytest.raises(PacketError, match="raw tensor bytes"):
        decode("raw", good, 2 * n, 2)
    with pytest.raises(PacketError, match="unknown tensor codec"):
        decode("lz4", good, 2 * n, 2)  # type: ignore[arg-type]
    with pytest.raises(PacketError, match="unknown tensor codec"):
        encode("lz4", good, 2)  # type: ignore[arg-type]
    with pytest.raises(PacketError, match="states 1048576 bytes, not the 64"):  # refused before decompressing
        decode(ZSTD, cases["a bomb: frame stating more than the plane"], 2 * n, 2)


def test_meta_claiming_fewer_bytes() -> None:
    """The header's shape bounds the decompression: a stream of a larger tensor does not decode as a smaller one."""
    _, sent = encode_tensor(torch.zeros(9, 64, dtype=torch.bfloat16), ZSTD)
    with pytest.raises(PacketError):
        decode_tensor(TensorMeta(dtype="bfloat16", shape=[8, 64], codec=ZSTD), sent)
    with pytest.raises(PacketError):
        decode_tensor(TensorMeta(dtype="float32", shape=[9, 32], codec=ZSTD), sent)  # same bytes, other planes


def test_wrong_codec_name_refused() -> None:
    fields, _ = sealed()
    fields[HEADER] = fields[HEADER].replace(b'"codec":"zstd-planes"', b'"codec":"brotli"')
    with pytest.raises(PacketError, match="codec"):
        decode_head_header(fields)
    with pytest.raises(ValidationError):
        TensorMeta(dtype="bfloat16", shape=[1], codec="lz4")  # type: ignore[arg-type]


def test_decoded_round_within_packet_cap() -> None:
    """A compressed round may not inflate past what a raw round could hold (checked before decoding)."""
    fields, _ = sealed(rows=64, width=256)
    msg = decode_head_header(fields)
    small = RelaySettings(max_packet_bytes=16 << 10)
    with pytest.raises(PacketError, match="packet cap"):
        round_tensors(msg, fields, caps=small)
    assert len(fields[TENSOR_PREFIX + b"hidden"]) < 32 << 10  # and yet the entry itself fits a 32 KiB cap


def test_round_rows_are_its_tokens() -> None:
    """Item 5 of issue 58: a round with k drafts carries k + 1 rows (its last committed token and its drafts), never
    a graph's padding to graph_k + 1: the header must say [len(input_ids) + len(draft_ids), hidden], the tensor must
    be what the header says, and a tail checks the rows against its tokens again."""
    k, graph_k, width = 3, 8, 64
    assert make_round(header(n=k + 1, k=k), {"hidden": torch.randn(k + 1, width)}, TEST_KEY)[0].tensors[
        "hidden"
    ].shape == [k + 1, width]
    with pytest.raises(ValidationError, match="hidden"):  # padded rows: refused before any byte is encoded
        make_round(header(n=k + 1, k=k), {"hidden": torch.randn(graph_k + 1, width)}, TEST_KEY, codec=ZSTD)
    metas = {"hidden": TensorMeta(dtype="float32", shape=[k + 1, width], codec=ZSTD)}
    packet, head = round_header(header(n=k + 1, k=k), metas, TEST_KEY)
    with pytest.raises(PacketError, match="its header says otherwise"):  # the head's split path
        round_fields(packet, head, {"hidden": torch.randn(graph_k + 1, width)})


def test_worth_compressing() -> None:
    assert not worth_compressing(None) and not worth_compressing(0.0)
    assert worth_compressing(25e6)  # 200 Mbit/s, the `notebooks` link
    assert not worth_compressing(10e9)  # faster than the codec
    assert not worth_compressing(1e3, ratio=1.0)
    # the break-even of the docstring's arithmetic, both sides of it
    even = 2 * (1 - 1 / RATIO) / (1 / ENCODE_BYTES_PER_S + 1 / DECODE_BYTES_PER_S) / MARGIN
    assert worth_compressing(even * 0.99) and not worth_compressing(even * 1.01)
    assert worth_compressing(even * 1.4, legs=3) and not worth_compressing(even * 0.6, legs=1)
    assert pick_codec("none", 1e3) == "raw" and pick_codec("zstd", 1e12) == ZSTD
    assert pick_codec("auto", None) == "raw" and pick_codec("auto", 25e6) == ZSTD and pick_codec("auto", 1e12) == "raw"
    assert set(CODECS) == {"raw", ZSTD}


def test_setting() -> None:
    assert Settings().relay.wire_codec == "auto"
    assert Settings().replace(relay={"wire_codec": "none"}).relay.wire_codec == "none"
    with pytest.raises(ValidationError):
        RelaySettings(wire_codec="lz4")  # type: ignore[arg-type]


def test_tail_serves_compressed_rounds(models, redis_client) -> None:
    """A real tail (`TailWorker.handle_many`, tiny Qwen2 split 2/4) needs no change: a greedy session whose rounds
    come compressed (bfloat16 rows, as a GPU head sends them) commits the tokens the same session commits raw."""
    target = models["qwen2"].target
    head = load_shard(target, (0, 2), embed=True, head=False, dtype=torch.float32)
    names = Keys(f"codec-{session_key().hex()[:8]}")
    redis_client.set(names.head(TEST_HEAD.name), TEST_HEAD.boot, ex=600)
    tail = TailWorker(load_shard(target, (2, 4), embed=False, head=True), redis_client, names=names)
    out = {}
    codecs: tuple[Codec, ...] = ("raw", ZSTD)
    for codec in codecs:
        key, cache, pending, start, tokens = session_key(), KVCache(), [5, 17, 42, 9], 0, []
        while len(tokens) < 6:
            with torch.inference_mode():
                hidden = head(torch.tensor(pending), start, cache).to(torch.bfloat16)
            over = dict(round_id=len(tokens), start_pos=start, input_ids=pending, max_new=6 - len(tokens))
            fields = encode_round(
                {**header(sid=codec[0] * 32, n=len(pending)), **over}, {"hidden": hidden}, key, codec=codec
            )[1]
            reply = tail.handle_many([fields])[0]
            assert reply is not None
            msg = decode_tail_message(reply.fields)
            assert isinstance(msg, Verdict), msg
            tokens += msg.tokens
            start, pending = start + len(pending), msg.tokens[-1:]
        out[codec] = tokens
    assert out["raw"] == out[ZSTD] and len(out[ZSTD]) == 6


def test_a_head_sending_compressed_rounds_equals_hf_generate(
    models, tails, redis_client, hf_models, tokenizers, monkeypatch
):
    """A head told to compress (`relay.wire_codec` zstd; `auto` picks it on a slow measured link) sends every round's
    hidden rows as byte planes with zstd, headers made ahead naming the codec, through a real tail process: each
    greedy generation equals HF generate, and the rows went compressed."""
    from concurrent.futures import ThreadPoolExecutor

    from schemas.requests import DraftSettings, GenerationRequest
    from schemas.settings import Settings
    from tests.conftest import PROMPTS
    from tests.job_env import reference
    from workers.head import sealing
    from workers.head.runtime import HeadRuntime, generate

    ms = models["qwen2"]
    names = tails.get(ms.target, 2, ms.n_layers)
    runtime = HeadRuntime.load(ms.target, (0, 2), draft=ms.drafter, settings=Settings(relay={"wire_codec": "zstd"}))
    codecs: list[str] = []
    fields = sealing.Outbound.fields

    def spy(self: sealing.Outbound) -> dict:
        codecs.append(self.made[0].tensors["hidden"].codec if self.made is not None else self.codec)
        return fields(self)

    monkeypatch.setattr(sealing.Outbound, "fields", spy)
    prompts = PROMPTS[:4]

    def one(p: str) -> list[int]:
        req = GenerationRequest(prompt=p, max_new_tokens=8, chat_template=False, draft=DraftSettings(k=4))
        return generate(req, runtime, redis_client, names=names).token_ids

    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(one, prompts))
    assert got == [reference(hf_models["qwen2"], tokenizers["qwen2"], p, 8) for p in prompts]
    assert codecs and set(codecs) == {ZSTD}
