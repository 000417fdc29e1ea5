"""The one tensor codec: dtype from an allow-list + shape + raw bytes. No pickle, ever.

A tensor travels as a `TensorMeta` (inside a packet's JSON header) plus its raw little-endian bytes
(a separate binary field). Decoding checks the dtype against the allow-list, the element count against
a cap, and the shape against the byte length, before any tensor is built.
"""

from __future__ import annotations

import math
import sys
import warnings
from typing import Annotated, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

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

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("ShardFlow's tensor codec assumes a little-endian host")


class TensorMeta(BaseModel):
    """Dtype and shape of one tensor whose raw bytes travel beside the header."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dtype: DTypeName
    shape: list[Annotated[int, Field(ge=0)]] = Field(max_length=8)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPES[self.dtype].itemsize


def tensor_meta(t: torch.Tensor) -> TensorMeta:
    """What `encode_tensor` says of `t` (nothing copied: its raw bytes may not exist on the host yet)."""
    name = DTYPE_NAMES.get(t.dtype)
    if name is None:
        raise PacketError(f"dtype {t.dtype} is not in the tensor allow-list {sorted(DTYPES)}")
    return TensorMeta(dtype=name, shape=list(t.shape))


def encode_tensor(t: torch.Tensor) -> tuple[TensorMeta, bytes]:
    """Return the meta and raw bytes of `t` (copied to host memory, made contiguous)."""
    meta = tensor_meta(t)
    host = t.detach().to("cpu").contiguous()
    raw = host.reshape(-1).view(torch.uint8).numpy().tobytes() if host.numel() else b""
    return meta, raw


def decode_tensor(
    meta: TensorMeta,
    raw: bytes | memoryview,
    *,
    max_elements: int = RelaySettings().max_tensor_elements,
    device: torch.device | str = "cpu",
    view: bool = False,
) -> torch.Tensor:
    """Build the tensor `meta` describes from `raw`, after checking size and byte length. view: on the host, a
    read-only view of `raw` itself, no copy (the caller copies it before anything could write to it)."""
    if meta.numel > max_elements:
        raise PacketError(f"tensor of {meta.numel} elements exceeds the cap of {max_elements}")
    if len(raw) != meta.nbytes:
        raise PacketError(f"tensor {meta.dtype}{meta.shape} needs {meta.nbytes} bytes, got {len(raw)} (truncated?)")
    dtype = DTYPES[meta.dtype]
    if meta.numel == 0:
        return torch.empty(meta.shape, dtype=dtype, device=device)
    if view:
        with warnings.catch_warnings():  # torch warns of every read-only buffer: this one is never written
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(raw, dtype=torch.uint8)
    else:
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return flat.view(dtype).reshape(meta.shape).to(device)
