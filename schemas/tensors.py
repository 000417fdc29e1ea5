"""The one tensor codec: dtype from an allow-list + shape + its bytes, raw, losslessly compressed or (opt-in) 8-bit.
No pickle, ever.

A tensor travels as a `TensorMeta` (inside a packet's JSON header) plus its little-endian bytes (a separate binary
field), as they are (`codec` raw, the default), compressed (`zstd-planes`: schemas/codec.py, which also says what
the MAC covers) or, for a floating tensor, as 8-bit codes with their scales (`fp8-rows`, `int8-blocks` and their
`-zstd` forms: lossy, decoded to the meta's dtype). Decoding checks the dtype against the allow-list and the element
count against a cap before it reads the bytes, and the bytes against the shape (a compressed stream: never inflated
past the shape's bytes) before any tensor is built.
"""

from __future__ import annotations

import math
import sys
import warnings
from typing import Annotated, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from schemas.codec import TensorCodec, decode, dequantize, encode, is_lossy, quantize
from schemas.errors import PacketError
from schemas.settings import RelaySettings

DTypeName = Literal["float32", "float16", "bfloat16", "float64", "int64", "int32", "uint8", "bool"]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
FLOATS = frozenset({"float32", "float16", "bfloat16", "float64"})

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("ShardFlow's tensor codec assumes a little-endian host")


class TensorMeta(BaseModel):
    """Dtype and shape of one tensor whose raw bytes travel beside the header."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dtype: DTypeName
    shape: list[Annotated[int, Field(ge=0)]] = Field(max_length=8)
    codec: TensorCodec = Field(
        "raw",
        description="How its bytes travel (schemas/codec.py). Left out of the JSON when raw: a raw tensor's header "
        "is what it was before codecs, and a tail of such a build refuses a compressed one (extra='forbid'). An 8-bit "
        "codec (lossy) only for a floating dtype; a build before them refuses it (not one of its codecs).",
    )

    @model_validator(mode="after")
    def _lossy_floats(self) -> TensorMeta:
        if is_lossy(self.codec) and self.dtype not in FLOATS:
            raise ValueError(f"codec {self.codec} sends floating tensors only, not {self.dtype}")
        return self

    @model_serializer(mode="wrap")
    def _raw_unsaid(self, handler: SerializerFunctionWrapHandler) -> dict:
        out = handler(self)
        if self.codec == "raw":
            out.pop("codec", None)
        return out

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPES[self.dtype].itemsize


def tensor_meta(t: torch.Tensor, codec: TensorCodec = "raw") -> TensorMeta:
    """What `encode_tensor` says of `t` (nothing copied: its raw bytes may not exist on the host yet)."""
    name = DTYPE_NAMES.get(t.dtype)
    if name is None:
        raise PacketError(f"dtype {t.dtype} is not in the tensor allow-list {sorted(DTYPES)}")
    return TensorMeta(dtype=name, shape=list(t.shape), codec=codec)


def encode_tensor(t: torch.Tensor, codec: TensorCodec = "raw") -> tuple[TensorMeta, bytes]:
    """Return the meta and the bytes of `t` as they travel under `codec` (copied to host memory, made contiguous;
    raw: its little-endian bytes; an 8-bit codec: its scales and codes, lossy)."""
    meta = tensor_meta(t, codec)
    if codec != "raw" and codec != "zstd-planes":  # 8-bit (is_lossy): scales and codes, lossy
        return meta, quantize(codec, t)
    host = t.detach().to("cpu").contiguous()
    if codec == "raw":
        return meta, host.reshape(-1).view(torch.uint8).numpy().tobytes() if host.numel() else b""
    return meta, encode(codec, host.reshape(-1).view(torch.uint8).numpy() if host.numel() else b"", t.element_size())


def decode_tensor(
    meta: TensorMeta,
    raw: bytes | memoryview,
    *,
    max_elements: int = RelaySettings().max_tensor_elements,
    device: torch.device | str = "cpu",
    view: bool = False,
) -> torch.Tensor:
    """Build the tensor `meta` describes from `raw` (its bytes as they came, under `meta.codec`), after checking
    size and byte length. view: on the host and raw, a read-only view of `raw` itself, no copy (the caller copies
    it before anything could write to it); a compressed or 8-bit tensor is decoded into a buffer of its own (8-bit:
    the dequantized values, in the meta's dtype)."""
    if meta.numel > max_elements:
        raise PacketError(f"tensor of {meta.numel} elements exceeds the cap of {max_elements}")
    dtype = DTYPES[meta.dtype]
    if meta.codec != "raw" and meta.codec != "zstd-planes":  # 8-bit (is_lossy)
        return dequantize(meta.codec, raw, dtype, meta.shape).to(device)
    if meta.codec != "raw":
        flat = torch.from_numpy(decode(meta.codec, raw, meta.nbytes, dtype.itemsize))
        return flat.view(dtype).reshape(meta.shape).to(device)
    if len(raw) != meta.nbytes:
        raise PacketError(f"tensor {meta.dtype}{meta.shape} needs {meta.nbytes} bytes, got {len(raw)} (truncated?)")
    if meta.numel == 0:
        return torch.empty(meta.shape, dtype=dtype, device=device)
    if view:
        with warnings.catch_warnings():  # torch warns of every read-only buffer: this one is never written
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(raw, dtype=torch.uint8)
    else:
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return flat.view(dtype).reshape(meta.shape).to(device)
