"""8-bit hidden rows on the wire (schemas/codec.py `fp8-rows`, `int8-blocks` and their `-zstd` forms; `relay.wire`):
lossy within the format's bounds, exact zeros, each float dtype decoded to itself, hostile streams refused as
PacketError, MACs over the quantized bytes, only a round's hidden rows lossy, the setting lossless by default, a tail
that refuses them on purpose or cannot decode them, and a head sending them to real tails."""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest
import torch
import zstandard
from pydantic import ValidationError

from schemas.codec import BLOCK, LOSSY, Lossy, dequantize, hidden_codec, lossy_nbytes, pick_codec, quantize
from schemas.errors import PacketError
from schemas.keys import Keys
from schemas.macs import authentic, seal, session_key
from schemas.packets import (
    HEADER,
    MAC,
    TENSOR_PREFIX,
    ErrorReply,
    RoundPacket,
    Verdict,
    decode_head_header,
    decode_tail_message,
    encode_round,
    make_round,
    round_tensors,
)
from schemas.requests import SamplingParams
from schemas.settings import RelaySettings, Settings
from schemas.tensors import DTYPE_NAMES, TensorMeta, decode_tensor, encode_tensor
from tests.relay_util import TEST_HEAD, TEST_KEY, TEST_REPLY_TO
from workers.engine.kvcache import KVCache
from workers.engine.shard import load_shard
from workers.head.link import LinkMeter
from workers.tail.server import TailWorker

FP8: Lossy = "fp8-rows"
INT8: Lossy = "int8-blocks"
FLOATS = [torch.bfloat16, torch.float16, torch.float32]
SHAPES = [[9, 576], [3, 5, 70], [1, 130], [7], [], [0, 576], [4, 0]]


def header(sid: str = "s" * 32, n: int = 3, k: int = 0, **over) -> dict:
    base = dict(
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
    )
    return base | over


def rows_like(dtype: torch.dtype, shape: list[int], seed: int = 0) -> torch.Tensor:
    """Activation-like values: mostly small, an outlier channel, a massive activation, exact zeros and a row of zeros
    among them."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g) * 3
    if t.ndim and t.numel() and t.shape[-1] > 8:
        t[..., 3] *= 40  # an outlier channel, as real hidden states have
        t[..., 5] = 0.0
        t.view(-1, t.shape[-1])[0, 7] = 20000.0  # a massive activation, as a first token's row has
    if t.ndim >= 2 and t.shape[0] > 1:
        t[1] = 0.0
    return t.to(dtype)


def stream_scales(codec: Lossy, sent: bytes, shape: list[int]) -> torch.Tensor:
    """Each value's scale as its stream holds it ([rows, width], float32; negative: an int8-blocks block sent fp8)."""
    width = shape[-1] if shape else 1
    rows = math.prod(shape[:-1]) if shape else 1
    block = BLOCK[codec.removesuffix("-zstd")] or width
    blocks = -(-width // block)
    scales = torch.from_numpy(np.frombuffer(sent[: 4 * rows * blocks], "<f4").copy()).view(rows, blocks)
    return scales.repeat_interleave(block, dim=1)[:, :width]


@pytest.mark.parametrize("codec", LOSSY)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", SHAPES)
def test_round_trip_within_bounds(codec: Lossy, dtype: torch.dtype, shape: list[int]) -> None:
    """Decoded to the meta's dtype and shape. A value sent fp8 (fp8-rows; an int8-blocks block whose scale is
    negative) is off by at most 2^-4 of itself (3 mantissa bits) or 2^-10 of its scale (subnormal codes), so by at
    most 2^-4 of its row's (block's) absolute maximum, its scale that maximum / 448; one sent int8 by at most half
    its block's scale, the block's absolute maximum / 127 (absmax / 254); each plus the dtype's own rounding of the
    result. Zeros stay exact zeros."""
    x = rows_like(dtype, shape)
    meta, sent = encode_tensor(x, codec)
    assert meta.codec == codec and meta.dtype == DTYPE_NAMES[dtype] and meta.shape == shape
    if not codec.endswith("-zstd"):
        assert len(sent) == lossy_nbytes(codec, shape)
    y = decode_tensor(meta, sent)
    assert y.dtype == dtype and list(y.shape) == shape
    if not x.numel():
        assert sent == b""
        return
    signed = stream_scales(codec, sent, shape)
    scale, as_fp8 = signed.abs(), torch.signbit(signed) | codec.startswith("fp8")
    xf, yf = x.float().reshape(scale.shape), y.float().reshape(scale.shape)
    block = BLOCK[codec.removesuffix("-zstd")] or xf.shape[-1]
    absmax = torch.cat([c.abs().amax(-1, keepdim=True).expand_as(c) for c in xf.split(block, dim=-1)], dim=-1)
    assert torch.allclose(scale, absmax / torch.where(as_fp8, 448.0, 127.0), rtol=1e-6, atol=0)
    err, own = (yf - xf).abs(), torch.finfo(dtype).eps * xf.abs() + 1e-30
    fp8_bound = torch.minimum(2**-4 * xf.abs() + 2**-10 * scale, 2**-4 * absmax) + own
    assert bool((err <= torch.where(as_fp8, fp8_bound, scale / 2 * (1 + 1e-5) + own)).all())
    assert bool((y[x == 0] == 0).all())
    if codec.startswith("int8") and shape == [9, 576]:  # the massive activation's block goes fp8, outlier-free int8
        assert bool(as_fp8[0, 7]) and not bool(as_fp8[:, 128:].any())


def test_int8_blocks_keep_a_massive_activations_row() -> None:
    """A row like a first token's (one value 20,000, the rest about 1): plain int8 would round the rest to 0; its
    block goes fp8, so they keep 2^-4 of themselves (or 2^-10 of the scale: 0.05) and the next block int8."""
    x = torch.randn(1, 256)
    x[0, 7] = 20000.0
    y = dequantize(INT8, quantize(INT8, x), torch.float32, [1, 256])
    err = (y - x).abs()
    assert bool((err[0, :128] <= 2**-4 * x[0, :128].abs() + 2**-10 * 20000 / 448).all())
    assert bool((err[0, 128:] <= x[0, 128:].abs().max() / 254 * (1 + 1e-5)).all())
    assert float(y[0, 7]) == 20000.0


@pytest.mark.parametrize("codec", LOSSY)
def test_zero_rows_scale_zero(codec: Lossy) -> None:
    x = torch.zeros(3, 100, dtype=torch.bfloat16)
    sent = quantize(codec, x)
    rows, blocks = 3, 1
    assert sent[: 4 * rows * blocks] == bytes(4 * rows * blocks)  # every scale 0.0
    assert torch.equal(dequantize(codec, sent, torch.bfloat16, [3, 100]), x)


def test_codes_compress_under_zstd() -> None:
    """The `-zstd` forms: the same scales and codes, the codes as one zstd frame stating their size."""
    x = rows_like(torch.bfloat16, [9, 3584])
    pairs: list[tuple[Lossy, Lossy]] = [(FP8, "fp8-rows-zstd"), (INT8, "int8-blocks-zstd")]
    for base, zstd in pairs:
        plain, packed = quantize(base, x), quantize(zstd, x)
        assert len(packed) < len(plain)
        back = dequantize(zstd, packed, torch.bfloat16, [9, 3584])
        assert torch.equal(dequantize(base, plain, torch.bfloat16, [9, 3584]), back)


@pytest.mark.parametrize("codec", [FP8, INT8])
def test_hostile_streams(codec: Lossy) -> None:
    """Every stream that is not what the header's shape implies is refused as PacketError before anything larger
    is allocated: a byte short or over, a scale that is not finite (fp8-rows: or negative), a NaN code, a scale too
    large for the dtype, a frame that states another size, a stream of a tensor of no elements."""
    shape, dt = [2, 64], torch.float16
    x = rows_like(dt, shape)
    sent = quantize(codec, x)
    head = 2 * 4
    for bad in (sent[:-1], sent + b"\0", b"", sent[:head]):
        with pytest.raises(PacketError, match=r"needs|bytes"):
            dequantize(codec, bad, dt, shape)
    for scale in (float("inf"), float("nan"), -1.0) if codec == FP8 else (float("inf"), float("nan")):
        with pytest.raises(PacketError, match="scale"):
            dequantize(codec, struct.pack("<f", scale) + sent[4:], dt, shape)
    with pytest.raises(PacketError, match="finite"):  # 1e30 x 448 (or 127) is no float16
        dequantize(codec, struct.pack("<f", 1e30) + sent[4:], dt, shape)
    as_fp8 = sent if codec == FP8 else struct.pack("<f", -abs(struct.unpack("<f", sent[:4])[0])) + sent[4:]
    with pytest.raises(PacketError, match="finite"):  # 0x7F is e4m3fn's NaN (int8-blocks: a block sent fp8)
        dequantize(codec, as_fp8[:head] + b"\x7f" + as_fp8[head + 1 :], dt, shape)
    # under -zstd: the codes as a frame, or as they are where it would not be smaller
    zstd: Lossy = "fp8-rows-zstd" if codec == FP8 else "int8-blocks-zstd"
    sparse, shape = torch.zeros(2, 640, dtype=dt), [2, 640]
    sparse[:, ::7] = 1 + torch.rand(2, 92, dtype=dt)
    sent, packed = quantize(codec, sparse), quantize(zstd, sparse)
    back = dequantize(codec, sent, dt, shape)
    assert len(packed) < len(sent) and torch.equal(dequantize(zstd, packed, dt, shape), back)
    assert torch.equal(dequantize(zstd, sent, dt, shape), back)
    head = len(sent) - 2 * 640
    lie = packed[:head] + zstandard.ZstdCompressor().compress(bytes(2 * 640 + 1))
    for bad in (lie, packed[:-1], packed + b"\0", sent + b"\0", sent[:head]):
        with pytest.raises(PacketError):
            dequantize(zstd, bad, dt, shape)
    with pytest.raises(PacketError, match="no elements"):
        dequantize(codec, b"\0" * 4, dt, [0, 64])
    with pytest.raises(PacketError, match="not finite"):
        quantize(codec, torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(PacketError, match="floating"):
        quantize(codec, torch.ones(2, 2, dtype=torch.int64))
    with pytest.raises(ValidationError, match="floating"):
        TensorMeta(dtype="int64", shape=[2], codec=codec)


def test_mac_covers_the_quantized_bytes() -> None:
    """The header names the codec and the MAC covers it and the codes as sent: a flipped code, a changed scale or
    a header naming another codec does not verify."""
    t = rows_like(torch.bfloat16, [3, 128])
    packet, fields = encode_round(header(), {"hidden": t}, TEST_KEY, hidden_codec=FP8)
    assert packet.tensors["hidden"].codec == FP8 and b'"codec":"fp8-rows"' in fields[HEADER]
    assert authentic(TEST_KEY, fields)
    name = TENSOR_PREFIX + b"hidden"
    sent = fields[name]
    for i in (0, len(sent) - 1):  # a scale's byte, a code
        forged = {**fields, name: sent[:i] + bytes([sent[i] ^ 1]) + sent[i + 1 :]}
        assert not authentic(TEST_KEY, forged)
    relabeled = {**fields, HEADER: fields[HEADER].replace(b"fp8-rows", b"int8-blocks")}
    assert not authentic(TEST_KEY, relabeled)
    msg = decode_head_header(fields)
    assert isinstance(msg, RoundPacket)
    back = round_tensors(msg, fields)["hidden"]
    assert back.dtype == torch.bfloat16 and (back.float() - t.float()).abs().max() <= t.float().abs().max() / 16


def test_only_hidden_rows_go_lossy() -> None:
    """A sampled round's q tensors stay lossless beside 8-bit hidden rows; a header naming a lossy q is refused."""
    k = 2
    q = {"q_idx": torch.tensor([[3, 4], [5, 6]]), "q_val": torch.tensor([[0.25, 0.75], [0.5, 0.5]])}
    over = dict(sampling=SamplingParams(temperature=0.8), q_kind="sparse")
    packet, fields = make_round(
        header(n=k + 1, k=k, **over), {"hidden": torch.randn(k + 1, 64), **q}, TEST_KEY, codec="zstd-planes",
        hidden_codec=FP8,
    )  # fmt: skip
    lossless = {"q_idx": "zstd-planes", "q_val": "zstd-planes"}
    assert {n: m.codec for n, m in packet.tensors.items()} == {"hidden": FP8, **lossless}
    got = round_tensors(packet, fields)
    assert torch.equal(got["q_val"], q["q_val"]) and torch.equal(got["q_idx"], q["q_idx"])
    metas = {n: m.model_dump() for n, m in packet.tensors.items()}
    metas["q_val"]["codec"] = FP8
    with pytest.raises(ValidationError, match="only the hidden rows"):
        RoundPacket.model_validate({**packet.model_dump(), "tensors": metas})


def test_setting_and_choice(monkeypatch) -> None:
    """Lossless unless asked (`relay.wire`, SHARDFLOW_RELAY__WIRE); 8-bit rows zstd'd where the lossless codec
    picked for the link is zstd-planes; a head's link meter names both."""
    assert Settings().relay.wire == "lossless" and RelaySettings().accept_lossy_wire
    monkeypatch.setenv("SHARDFLOW_RELAY__WIRE", "fp8")
    assert Settings().relay.wire == "fp8"
    with pytest.raises(ValidationError):
        RelaySettings(wire="fp4")  # type: ignore[arg-type]
    assert hidden_codec("lossless", "raw") == "raw" and hidden_codec("lossless", "zstd-planes") == "zstd-planes"
    assert hidden_codec("fp8", "raw") == FP8 and hidden_codec("fp8", pick_codec("zstd", None)) == "fp8-rows-zstd"
    assert hidden_codec("int8", pick_codec("auto", 25e6)) == "int8-blocks-zstd"
    meter = LinkMeter(wire_codec="none", wire="int8")
    assert meter.codec() == "raw" and meter.hidden_codec() == INT8
    assert LinkMeter().hidden_codec() == "raw"


def test_head_flag(monkeypatch) -> None:
    """`shardflow head --wire fp8` sets relay.wire (the flag maps onto the setting as every head flag does)."""
    from click.testing import CliRunner

    from producer import cli_workers

    seen: dict = {}

    def stop(*_a, **_k):
        raise SystemExit(0)

    monkeypatch.setattr("producer.cli_workers.run_guarded", lambda f: None)
    monkeypatch.setattr("producer.cli_workers.torch_setup", lambda s: seen.setdefault("wire", s.relay.wire) and stop())
    got = CliRunner().invoke(cli_workers.head, ["--target", "x", "--layers", "0:1", "--wire", "fp8"])
    assert seen.get("wire") == "fp8", got.output
    assert CliRunner().invoke(cli_workers.head, ["--target", "x", "--wire", "fp4"]).exit_code == 2


def parts_at(got: list[int], want: list[int]) -> int | None:
    """The first token where `got` parts from `want` (None: equal)."""
    end = None if len(got) == len(want) else min(len(got), len(want))
    return next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), end)


def _tail(models, redis_client, **relay) -> tuple[TailWorker, torch.nn.Module]:
    target = models["qwen2"].target
    head = load_shard(target, (0, 2), embed=True, head=False, dtype=torch.float32)
    names = Keys(f"w8-{session_key().hex()[:8]}")
    redis_client.set(names.head(TEST_HEAD.name), TEST_HEAD.boot, ex=600)
    settings = Settings(relay=relay) if relay else None
    tail = TailWorker(load_shard(target, (2, 4), embed=False, head=True), redis_client, names=names, settings=settings)
    return tail, head


def test_tail_serves_8bit_rows(models, redis_client) -> None:
    """A real tail (`TailWorker.handle_many`, tiny Qwen2 split 2/4) decodes 8-bit rows to its dtype and serves a
    greedy session through to its last token, for each codec (the tokens may differ from a raw session's: lossy)."""
    tail, head = _tail(models, redis_client)
    for i, codec in enumerate((*LOSSY, "raw")):
        key, cache, pending, start, tokens = session_key(), KVCache(), [5, 17, 42, 9], 0, []
        while len(tokens) < 6:
            with torch.inference_mode():
                hidden = head(torch.tensor(pending), start, cache).to(torch.bfloat16)
            over = dict(round_id=len(tokens), start_pos=start, input_ids=pending, max_new=6 - len(tokens))
            sid = f"w8-{i}".ljust(32, "x")
            fields = encode_round({**header(sid=sid, n=len(pending)), **over}, {"hidden": hidden}, key,
                                  hidden_codec=codec)[1]  # fmt: skip
            reply = tail.handle_many([fields])[0]
            assert reply is not None
            msg = decode_tail_message(reply.fields)
            assert isinstance(msg, Verdict), msg
            tokens += msg.tokens
            start, pending = start + len(pending), msg.tokens[-1:]
        assert len(tokens) == 6


def test_tail_refusals(models, redis_client) -> None:
    """A tail with `relay.accept_lossy_wire` false answers an 8-bit round with a MAC'd, non-retryable error (the
    head replays the session elsewhere, then fails it) and dead-letters it; a raw round it serves. A codec this
    build does not know (as a build before 8-bit rows sees `fp8-rows`) is a dead letter that names it, no crash and
    no answer."""
    tail, head = _tail(models, redis_client, accept_lossy_wire=False)
    with torch.inference_mode():
        hidden = head(torch.tensor([5, 17, 42]), 0, KVCache())
    key = session_key()
    fields = encode_round(header(sid="r" * 32), {"hidden": hidden}, key, hidden_codec=FP8)[1]
    reply = tail.handle_many([fields])[0]
    assert reply is not None and authentic(key, reply.fields, reply=True)
    msg = decode_tail_message(reply.fields)
    assert isinstance(msg, ErrorReply) and not msg.retryable and not msg.busy and "accept_lossy_wire" in msg.error
    assert any("8-bit" in d.reason for d in tail.take_dead_letters())
    raw = encode_round(header(sid="w" * 32), {"hidden": hidden}, key)[1]
    assert isinstance(decode_tail_message(tail.handle_many([raw])[0].fields), Verdict)  # type: ignore[union-attr]

    h = json.loads(fields[HEADER])
    h["session_id"], h["tensors"]["hidden"]["codec"] = "u" * 32, "fp4-rows"
    unknown = seal(key, {k: v for k, v in fields.items() if k != MAC} | {HEADER: json.dumps(h).encode()})
    assert tail.handle_many([unknown])[0] is None
    (letter,) = tail.take_dead_letters()
    assert "tensors.hidden.codec" in letter.reason and "fp8-rows" in letter.reason


def test_a_head_sending_fp8_rows_completes(models, tails, redis_client, hf_models, tokenizers, monkeypatch) -> None:
    """A head with `relay.wire` fp8 sends every round's hidden rows as fp8 (headers made ahead and the opening round
    naming the codec) to a real tail process, and every generation completes: greedy ones are compared with HF
    generate and their divergences counted (lossy: not asserted equal), a sampled one's q tensors stay lossless."""
    from concurrent.futures import ThreadPoolExecutor

    from schemas.requests import DraftSettings, GenerationRequest
    from tests.conftest import PROMPTS
    from tests.job_env import reference
    from workers.head import sealing
    from workers.head.runtime import HeadRuntime, generate

    ms = models["qwen2"]
    names = tails.get(ms.target, 2, ms.n_layers)
    runtime = HeadRuntime.load(ms.target, (0, 2), draft=ms.drafter, settings=Settings(relay={"wire": "fp8"}))
    seen: list[dict[str, str]] = []
    fields_of = sealing.Outbound.fields

    def spy(self: sealing.Outbound) -> dict:
        fields = fields_of(self)  # unsealed: its header as made
        msg = RoundPacket.model_validate_json(fields[HEADER])
        seen.append({"opens": str(msg.start_pos == 0), **{n: m.codec for n, m in msg.tensors.items()}})
        return fields

    monkeypatch.setattr(sealing.Outbound, "fields", spy)
    prompts, n = PROMPTS[:4], 8

    def one(p: str, temperature: float = 0.0) -> list[int]:
        sampling = SamplingParams(temperature=temperature, seed=7)
        req = GenerationRequest(prompt=p, max_new_tokens=n, chat_template=False, draft=DraftSettings(k=4),
                                sampling=sampling)  # fmt: skip
        return generate(req, runtime, redis_client, names=names).token_ids

    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(one, prompts))
    want = [reference(hf_models["qwen2"], tokenizers["qwen2"], p, n) for p in prompts]
    parted = [parts_at(g, w) for g, w in zip(got, want, strict=True)]
    print(f"fp8 rows, tiny qwen2 float32: {sum(p is not None for p in parted)}/{len(prompts)} part from HF at {parted}")
    assert all(len(g) == n for g in got)
    assert seen and {s["hidden"] for s in seen} == {FP8} and any(s["opens"] == "True" for s in seen)
    seen.clear()
    assert len(one(prompts[0], temperature=0.9)) == n
    assert {s["hidden"] for s in seen} == {FP8}
    assert any("q_val" in s or "q" in s for s in seen), seen  # a sampled round with q tensors, lossless
    assert all(s.get(q, "raw") in ("raw", "zstd-planes") for s in seen for q in ("q", "q_idx", "q_val"))
