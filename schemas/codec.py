"""Codecs for a tensor's bytes on the wire: lossless ones, the rule for when compressing pays, and opt-in 8-bit ones.

A tensor's `TensorMeta.codec` (schemas/tensors.py) names how its bytes travel:

- `raw`: its little-endian bytes as they are (the default, and what every header that names no codec means).
- `zstd-planes`: its bytes split into byte planes, each compressed with zstd (the `zstandard` library) where that
  makes it smaller. For a tensor of n elements of s bytes (little-endian), plane i (i = 0 .. s-1) holds byte s-1-i
  of every element: the most significant first, so for floats the plane of the sign and the exponent's high bits,
  which compresses well (activations' exponents take few values), then the mantissa's planes, which compress
  little. The stream is s lengths (uint32, little-endian), then the s stored planes back to back. A stored plane of
  exactly n bytes is the plane as it is; a shorter one is one zstd frame that states its content size, n; any other
  length is refused. Nothing else may follow. So a tensor never takes more than 4 bytes a plane beyond its raw
  bytes (what sizes a long prompt's parts, workers/head/sealing.py `part_tokens`, stays true).

**What the MAC covers.** A round's MAC (schemas/macs.py; in a group entry, its binding to the group's tensors,
schemas/groups.py) covers its header, which names each tensor's dtype, shape and codec, and each tensor's bytes as
sent: the compressed stream, not the tensor it decodes to. A tail checks it before any tensor is decoded
(`round_tensors` runs only on an authentic entry), so a forged or altered entry costs no decompression; and
`decode` never writes more than the header's n bytes a plane (the frame must state n before anything is
decompressed; zstd then refuses a frame that holds more or less), so a key holder can make a tail decompress at
most the bytes its header declares, within the tensor and packet caps (`round_tensors`).

**What it saves, measured** (`python -m bench.codec`, docs/benchmarks.md "Lossless wire codec", 2026-12-07, this
2-core CPU, one thread): SmolLM2-135M-Instruct's real hidden states entering layer 15 of 30, 8 prompts with 64
greedy tokens each, cut into K = 8 rounds of 9 rows and re-cut to 9 rows of 3,584 (Qwen2.5-7B's width: 64.5 KB a
round in bfloat16). No 7B runs on this CPU, and random-normal values are a poor stand-in for real activations, so
the 7B shape holds SmolLM2's values. Bytes saved: bfloat16 1.44x (the sign-and-exponent plane 2.6x, the mantissa
plane not at all), float16 1.15x (5 exponent bits), float32 1.18x. `RATIO`, `ENCODE_BYTES_PER_S` and
`DECODE_BYTES_PER_S` are the bfloat16 9 x 3,584 figures (raw bytes a second, one core): what `worth_compressing`
assumes unless told. On these rounds plain zstd 1 (no planes) saves 1.27x, every plane at zstd 1 1.43x at 0.7x
this speed, every plane at zstd 3 1.40x at 0.4x, lz4 nothing, byte planes then lz4 1.14x (it has no entropy coder,
which is what the exponents need).

Levels: the most significant plane at zstd level 1 with a minimum match of 7 (`TOP`: level 1's own, 6, was slower
for a slightly worse ratio; level 3 no smaller), the other planes at level -1 (the same bytes as level 1 on these
planes, which gain only from zstd's entropy coding where they gain at all, in a fraction of the time). zstd lets go
of the interpreter lock while it compresses or decompresses a plane.

**8-bit rows, lossy and opt-in** (`relay.wire`: `fp8` or `int8`; never the default). Only a round's hidden rows go
this way (its q tensors stay lossless: `RoundPacket` refuses a lossy codec on any other tensor), as `hidden_codec`
names it from the setting and the lossless codec picked for the link. A floating tensor of shape [..., w] is r rows
of w values (r: the product of the other dimensions; a 0-d tensor one row of one), each row cut into blocks of
`BLOCK[codec]` values (the last one shorter; `fp8-rows`: the whole row is one block), b blocks a row:

- `fp8-rows`: one scale a row, its absolute maximum / 448, and each value / its scale as float8 e4m3 (e4m3fn: 3
  mantissa bits, largest 448; a value is off by at most 2^-4 of itself, or 2^-10 of its scale below 2^-6 of it);
- `int8-blocks`: one scale every 128 values of a row, the block's absolute maximum / 127, and each value / its scale
  rounded to an int8 in [-127, 127] (off by at most half its block's scale: absmax / 254); but a block whose values
  would err less (sum of squares) as fp8 goes as fp8 under its own scale (absmax / 448), stored negative. Such are
  the blocks that hold an outlier many times their other values (massive activations: the first token's row, a
  few channels), whose other values int8 would round to 0. SmolLM2 (below) parted from its greedy text in 16 of 16
  generations with plain int8 blocks of 128 (15 with blocks of 64, 16 with one scale a row), in 6 of 16 with this.

The stream is the r x b scales (float32, little-endian, row by row: finite, else refused; fp8-rows' not negative),
then the r x w codes (one byte each, row by row). Under `-zstd` (`fp8-rows-zstd`, `int8-blocks-zstd`: where the
lossless codec picked for the link is `zstd-planes`) the codes are one zstd frame that states their size (`TOP`'s
parameters; the scales stay as they are), or as they are where that frame would not be smaller. So a stream is
exactly 4 r b + r w bytes, or, under `-zstd`, 4 r b bytes and a frame shorter than r w that states r w: anything
else is refused before anything is decompressed. A tail decodes to the header's dtype (the model's: each code's
value times its scale in float32, then rounded to it), and refuses rows that do not come out finite in it (a NaN
code, a scale too large). The MAC covers the header, which names the codec, and the stream as sent. A tail with
`relay.accept_lossy_wire` false answers such a round with an error (workers/tail/server.py); a tail of a build before
these codecs refuses its header ("tensors.hidden.codec: Input should be 'raw' or 'zstd-planes'"): a dead letter with
that reason, and no answer (its head replays the session after its reply timeout, then fails it).

**What they cost, measured** (this 2-core CPU, 2026-12-07; docs/benchmarks.md "8-bit wire"): SmolLM2-135M-Instruct
(Llama family, its float32 checkpoint) split 15/15, 16 chat prompts x 64 greedy tokens, every row entering layer 15
(prompts' too) sent through the codec, against the same model unsplit: fp8-rows parted from its text in 12 of 16
generations (4 within the first 2 tokens), int8-blocks in 6 of 16 (the first at token 16); rounding the float32 rows
to bfloat16 alone parted in 2. Bytes, on K = 8 rounds of its real hidden states (9 x 576, and re-cut to 9 x 3,584 as
`RATIO` is): a bfloat16 round 2.00x fewer than raw as fp8-rows (2.25x with zstd; zstd-planes alone 1.44x),
int8-blocks 1.94x (2.11x); a float32 round 4.0x (4.5x) and 3.9x (4.2x). One core, a bfloat16 9 x 3,584 round:
fp8-rows 90 us to encode, 78 us to decode; int8-blocks 300 us to encode (both codes are tried) and 85 us to decode
(zstd-planes: 114 and 44 us); with zstd on the codes about 40 us more each way.
"""

from __future__ import annotations

import math
import threading
from typing import Literal, get_args

import numpy as np
import torch
import zstandard

from schemas.errors import PacketError
from schemas.settings import Wire, WireCodec

Codec = Literal["raw", "zstd-planes"]  # lossless
CODECS: tuple[Codec, ...] = get_args(Codec)
Lossy = Literal["fp8-rows", "fp8-rows-zstd", "int8-blocks", "int8-blocks-zstd"]  # 8-bit codes and their scales
LOSSY: tuple[Lossy, ...] = get_args(Lossy)
TensorCodec = Literal[Codec, Lossy]  # what a tensor's meta may name
LOSSY_BASE: dict[Wire, Lossy] = {"fp8": "fp8-rows", "int8": "int8-blocks"}  # `relay.wire` -> its codec
BLOCK: dict[str, int | None] = {"fp8-rows": None, "int8-blocks": 128}  # values a scale covers (None: a whole row)
QMAX = {"fp8-rows": 448.0, "int8-blocks": 127.0}  # the largest code: a block's absolute maximum maps to it
_SCALE = 4  # bytes of a scale (float32)
Buffer = bytes | memoryview | np.ndarray  # a tensor's raw bytes: a uint8 array, or anything that holds them

# The planes' zstd parameters (see the module docstring): the most significant plane, then every other.
TOP = zstandard.ZstdCompressionParameters.from_level(1, min_match=7)
REST_LEVEL = -1

# Measured (module docstring): bfloat16 rows of 3,584 from SmolLM2's real hidden states, this 2-core CPU, one thread.
RATIO = 1.44  # raw bytes / bytes sent
ENCODE_BYTES_PER_S = 530e6  # raw bytes a second, head side (plane split + zstd): 122 us a 64.5 KB round
DECODE_BYTES_PER_S = 1.26e9  # raw bytes a second, tail side (zstd + plane join): 51 us a 64.5 KB round
LEGS = 2  # each byte crosses two links: head -> Redis, Redis -> tail
MARGIN = 3.0  # compression must save this many times its codec time (`worth_compressing`)

_LEN = 4  # bytes of each plane's stored length
_UINT = {1: np.uint8, 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}
_local = threading.local()  # zstd contexts are not thread-safe: one set per thread (a head sends on several)


def _contexts() -> tuple[zstandard.ZstdCompressor, zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        ctx = _local.ctx = (
            zstandard.ZstdCompressor(compression_params=TOP),
            zstandard.ZstdCompressor(level=REST_LEVEL),
            zstandard.ZstdDecompressor(),
        )
    return ctx


def split_planes(raw: Buffer, itemsize: int) -> list[np.ndarray]:
    """The byte planes of little-endian elements of `itemsize` bytes, most significant first (uint8 arrays)."""
    u = np.frombuffer(raw, dtype=np.uint8)
    if itemsize not in _UINT or u.size % itemsize:
        raise PacketError(f"{u.size} bytes are no whole number of {itemsize}-byte elements")
    u = u.view(_UINT[itemsize])
    if itemsize == 1:
        return [u]
    return [(u >> (8 * (itemsize - 1 - i))).astype(np.uint8) for i in range(itemsize)]


def join_planes(planes: list[np.ndarray], itemsize: int) -> np.ndarray:
    """The elements' little-endian bytes (a writable uint8 array) from their planes, most significant first."""
    if itemsize == 1:
        return planes[0] if planes[0].flags.writeable else planes[0].copy()
    out = planes[0].astype(_UINT[itemsize])
    for p in planes[1:]:
        out <<= 8
        out |= p
    return out.view(np.uint8)


def encode(codec: Codec, raw: Buffer, itemsize: int) -> bytes:
    """What goes on the wire for a tensor's raw little-endian bytes under `codec` (module docstring)."""
    if codec == "raw":
        return bytes(raw)
    if codec != "zstd-planes":
        raise PacketError(f"unknown tensor codec {codec!r}: this build knows {list(CODECS)}")
    top, rest, _ = _contexts()
    stored = []
    for i, plane in enumerate(split_planes(raw, itemsize)):
        packed = (top if i == 0 else rest).compress(plane)
        stored.append(packed if len(packed) < len(plane) else plane.tobytes())
    return b"".join(len(s).to_bytes(_LEN, "little") for s in stored) + b"".join(stored)


def decode(codec: Codec, data: bytes | memoryview, nbytes: int, itemsize: int) -> np.ndarray:
    """A tensor's raw bytes (exactly nbytes, its header's: a uint8 array, writable unless raw, which is a view of
    `data`) from what came on the wire under `codec`; PacketError, before anything larger is allocated, for a stream
    that is not what the format says (module docstring)."""
    if codec == "raw":
        if len(data) != nbytes:
            raise PacketError(f"raw tensor bytes: {len(data)}, its header says {nbytes}")
        return np.frombuffer(data, np.uint8)
    if codec != "zstd-planes":
        raise PacketError(f"unknown tensor codec {codec!r}: this build knows {list(CODECS)}")
    if itemsize not in _UINT or nbytes % itemsize:
        raise PacketError(f"{nbytes} bytes are no whole number of {itemsize}-byte elements")
    n, view = nbytes // itemsize, memoryview(data)
    head = _LEN * itemsize
    if len(view) < head:
        raise PacketError(f"zstd-planes stream of {len(view)} bytes is shorter than its {head}-byte table (truncated?)")
    lengths = [int.from_bytes(view[i * _LEN : (i + 1) * _LEN], "little") for i in range(itemsize)]
    if any(m > n for m in lengths) or head + sum(lengths) != len(view):
        raise PacketError(
            f"zstd-planes stream of {len(view)} bytes does not match its plane lengths {lengths} "
            f"({itemsize} planes of {n} bytes at most)"
        )
    dctx, planes, at = _contexts()[2], [], head
    for i, m in enumerate(lengths):
        stored, at = view[at : at + m], at + m
        planes.append(
            np.frombuffer(stored, np.uint8) if m == n else _inflate(dctx, stored, n, f"zstd-planes plane {i}")
        )
    return join_planes(planes, itemsize)


def _inflate(dctx: zstandard.ZstdDecompressor, frame: memoryview, n: int, what: str) -> np.ndarray:
    """`what` (a stream's plane, or its codes: named so in errors) from its zstd frame, which must state exactly n
    bytes (checked before anything is decompressed)."""
    try:
        size = zstandard.get_frame_parameters(frame).content_size
        if size != n:  # unknown or another size: a bomb or a forgery is never decompressed
            said = "no size" if size == zstandard.CONTENTSIZE_UNKNOWN else f"{size} bytes"
            raise PacketError(f"{what} states {said}, not the {n} its header's shape holds")
        out = dctx.decompress(frame, max_output_size=n, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise PacketError(f"{what} does not decompress: {e}") from None
    if len(out) != n:  # zstd checks the stated size; this is only a second look
        raise PacketError(f"{what} holds {len(out)} bytes, not {n}")
    return np.frombuffer(out, np.uint8)


def worth_compressing(
    link_bytes_per_s: float | None,
    ratio: float = RATIO,
    encode_bytes_per_s: float = ENCODE_BYTES_PER_S,
    decode_bytes_per_s: float = DECODE_BYTES_PER_S,
    *,
    legs: int = LEGS,
) -> bool:
    """Whether sending `zstd-planes` rather than `raw` makes a tensor arrive sooner over a link of
    `link_bytes_per_s` (delivered bytes a second, each way; None: not measured, or no cap: False).

    Per raw byte, compressing to 1/ratio saves (1 - 1/ratio) / link seconds on each of the `legs` links it crosses
    (two: head -> Redis -> tail, Redis in the middle) and costs 1 / encode + 1 / decode seconds of CPU on the two
    ends. It pays where

        legs * (1 - 1/ratio) / link  >  1/encode + 1/decode.

    It must pay `MARGIN` times over: the codec's CPU time lands on threads that also drive the GPU (the head's
    senders beside its loop, the tail's loop itself decodes), and a link's measured bandwidth wavers. With the
    measured defaults (ratio 1.44, 530 MB/s and 1.26 GB/s) the break-even link is about 230 MB/s (1.8 Gbit/s), so
    compression goes on below about 77 MB/s (600 Mbit/s). On one H100 through an uncapped 86 ms link, compressing at
    the bare break-even cost 256 jobs 7% (2,573 against 2,749 tok/s raw, 2026-12-08): the link there is a Python
    proxy whose measured bandwidth hovered near it. At 200 Mbit/s (25 MB/s) a 64.5 KB bfloat16 round of a 7B model
    saves about 1.6 ms of wire time (0.8 ms a leg) for about 0.17 ms of codec time: 9 times over.
    """
    if link_bytes_per_s is None or link_bytes_per_s <= 0 or ratio <= 1:
        return False
    saved = legs * (1 - 1 / ratio) / link_bytes_per_s
    return saved > MARGIN * (1 / encode_bytes_per_s + 1 / decode_bytes_per_s)


def pick_codec(setting: WireCodec, link_bytes_per_s: float | None) -> Codec:
    """The lossless codec a head sends under the `relay.wire_codec` setting: `none` raw, `zstd` zstd-planes, `auto`
    zstd-planes only where `worth_compressing` says so for the link as measured (raw while it is not). Every
    tensor of a round goes this way, its hidden rows too unless `relay.wire` says otherwise (`hidden_codec`)."""
    if setting == "zstd":
        return "zstd-planes"
    if setting == "auto" and worth_compressing(link_bytes_per_s):
        return "zstd-planes"
    return "raw"


def hidden_codec(wire: Wire, lossless: Codec) -> TensorCodec:
    """The codec of a round's hidden rows under the `relay.wire` setting, given the lossless codec picked for the
    link (`pick_codec`): that one where `wire` is lossless (the default); else the setting's 8-bit codec, its
    codes zstd'd where the lossless codec is zstd-planes (the module docstring)."""
    if wire == "lossless":
        return lossless
    base = LOSSY_BASE[wire]
    return f"{base}-zstd" if lossless == "zstd-planes" else base  # type: ignore[return-value]


def is_lossy(codec: str) -> bool:
    """Whether tensors sent under `codec` arrive other than they were sent (8-bit rows)."""
    return codec in LOSSY


def _base(codec: Lossy) -> str:
    return codec.removesuffix("-zstd")


def _layout(codec: Lossy, shape: list[int] | tuple[int, ...]) -> tuple[int, int, int, int]:
    """(rows, values a row, blocks a row, values a block) of a tensor of `shape` under a lossy codec."""
    width = int(shape[-1]) if len(shape) else 1
    rows = math.prod(shape[:-1]) if len(shape) else 1
    block = BLOCK[_base(codec)] or width
    return rows, width, -(-width // block) if width else 0, block


def lossy_nbytes(codec: Lossy, shape: list[int] | tuple[int, ...]) -> int:
    """The bytes of a tensor of `shape` under a lossy codec, its codes uncompressed: scales and codes."""
    rows, width, blocks, _ = _layout(codec, shape)
    return rows * (blocks * _SCALE + width)


def quantize(codec: Lossy, t: torch.Tensor) -> bytes:
    """What goes on the wire for a floating tensor under a lossy codec (the module docstring); PacketError for a
    tensor that is not floating or holds a value that is not finite (no scale could hold it)."""
    if codec not in LOSSY:
        raise PacketError(f"{codec!r} is no 8-bit codec: this build knows {list(LOSSY)}")
    if not t.is_floating_point():
        raise PacketError(f"{codec} sends floating tensors only, not {t.dtype}")
    rows, width, blocks, block = _layout(codec, tuple(t.shape))
    if rows * width == 0:
        return b""
    x = t.detach().to("cpu", torch.float32).reshape(rows, width)
    if blocks * block != width:
        x = torch.nn.functional.pad(x, (0, blocks * block - width))
    x = x.view(rows, blocks, block)
    amax = x.abs().amax(-1)  # [rows, blocks]; 0 for a block of zeros, NaN or inf for one that is not finite
    if not bool(torch.isfinite(amax).all()):
        raise PacketError(f"{codec}: the tensor holds values that are not finite")
    fp8_scales = amax / QMAX["fp8-rows"]
    fp8 = _fp8_codes(x, fp8_scales)
    if _base(codec) == "fp8-rows":
        codes, scales = fp8, fp8_scales
    else:  # each block int8, or fp8 where that errs less (its scale negative)
        int8_scales = amax / QMAX["int8-blocks"]
        steps = (x / _nonzero(int8_scales)).round_().clamp_(-127, 127)
        int8_err = (steps * int8_scales.unsqueeze(-1) - x).square_().sum(-1)
        values = torch.from_numpy(np.take(_VALUES["fp8-rows"], fp8.numpy()))
        fp8_err = (values * fp8_scales.unsqueeze(-1) - x).square_().sum(-1)
        as_fp8 = fp8_err < int8_err
        codes, scales = steps.to(torch.int8).view(torch.uint8), torch.where(as_fp8, -fp8_scales, int8_scales)
        if bool(as_fp8.any()):
            codes[as_fp8] = fp8[as_fp8]
    stored = codes.reshape(rows, blocks * block)[:, :width].numpy().tobytes()
    if codec.endswith("-zstd") and len(packed := _contexts()[0].compress(stored)) < len(stored):
        stored = packed
    return scales.numpy().astype("<f4", copy=False).tobytes() + stored


def _nonzero(scales: torch.Tensor) -> torch.Tensor:
    """Scales to divide a block by ([rows, blocks, 1]): a block of zeros (scale 0) by 1."""
    return torch.where(scales > 0, scales, 1.0).unsqueeze(-1)


def _fp8_codes(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The e4m3fn codes (uint8) of blocks `x` [rows, blocks, block] under their `scales` [rows, blocks]."""
    return (x / _nonzero(scales)).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)


# What each code means before its scale: int8's 256, then e4m3fn's 256 (two of them NaN)
_VALUES = {
    "int8-blocks": np.arange(256, dtype=np.uint8).view(np.int8).astype(np.float32),
    "fp8-rows": torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32).numpy(),
}
_BOTH = np.concatenate([_VALUES["int8-blocks"], _VALUES["fp8-rows"]])  # an int8-blocks block's, by its scale's sign


def dequantize(codec: Lossy, data: bytes | memoryview, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """The tensor (`dtype`, `shape`: its header's) that a lossy codec's stream holds; PacketError, before anything
    larger than the header implies is allocated, for a stream that is not what the format says, a scale that is
    not finite (or, fp8-rows, negative), or values that do not dequantize to finite ones in `dtype` (the module
    docstring)."""
    if codec not in LOSSY:
        raise PacketError(f"{codec!r} is no 8-bit codec: this build knows {list(LOSSY)}")
    if not dtype.is_floating_point:
        raise PacketError(f"{codec} carries floating tensors only, not {dtype}")
    rows, width, blocks, block = _layout(codec, shape)
    n, head, view = rows * width, rows * blocks * _SCALE, memoryview(data)
    if n == 0:
        if len(view):
            raise PacketError(f"{codec} stream of {len(view)} bytes for a tensor of no elements")
        return torch.empty(shape, dtype=dtype)
    if codec.endswith("-zstd"):
        if not head < len(view) <= head + n:
            raise PacketError(f"{codec} stream of {len(view)} bytes: its header's shape needs {head} and at most {n}")
        stored, what = view[head:], f"{codec} codes"
        codes = np.frombuffer(stored, np.uint8) if len(stored) == n else _inflate(_contexts()[2], stored, n, what)
    else:
        if len(view) != head + n:
            raise PacketError(f"{codec} stream of {len(view)} bytes, its header's shape needs {head + n} (truncated?)")
        codes = np.frombuffer(view[head:], np.uint8)
    scales = np.frombuffer(view[:head], "<f4").reshape(rows, blocks)
    fp8_rows = _base(codec) == "fp8-rows"
    if not np.isfinite(scales).all() or (fp8_rows and np.signbit(scales).any()):
        raise PacketError(f"{codec}: a scale is not finite" + (" or is negative" if fp8_rows else ""))
    if fp8_rows:
        x = np.take(_VALUES["fp8-rows"], codes).reshape(rows, width)  # float32
        x *= scales
    else:
        signs = np.signbit(scales)  # the blocks sent as fp8
        if signs.any():
            index = codes.reshape(rows, width) + (np.repeat(signs, block, axis=1)[:, :width] * np.uint16(256))
            x = np.take(_BOTH, index)
        else:
            x = np.take(_VALUES["int8-blocks"], codes).reshape(rows, width)
        x *= np.repeat(np.abs(scales), block, axis=1)[:, :width] if blocks > 1 else np.abs(scales)
    out = torch.from_numpy(x).to(dtype).reshape(shape)
    if not np.abs(x).max() <= torch.finfo(dtype).max and not bool(torch.isfinite(out).all()):
        raise PacketError(f"{codec}: the rows do not dequantize to finite {dtype} values")  # a NaN code, a huge scale
    return out
