"""Group messages: one stream entry carries the rounds of every session of one of a head's groups.

Each session's round is still its own sealed message (schemas/packets.py: header, tensors, and a MAC under the
session's key); a group entry packs them, so a tail reads, validates and acks one entry per group and a head
publishes one:

  g           the index (JSON, `GroupIndex`): for each part, its header's byte length and each tensor's
  h           every part's header, back to back
  t.<name>    every part's tensor `name`, back to back: `t.hidden` is one [sum of rows, hidden] tensor
  m           every part's MAC (32 bytes each), back to back

`unpack_group` gives back each part's own stream fields exactly as the head sealed them, so a tail checks,
dedups, answers and dead-letters each session as if it had come alone: a bad part fails its own session only.
A stage that forwards a group rather than verifying it can pass parts on unopened.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from schemas.errors import PacketError
from schemas.packets import HEADER, MAC, PROTOCOL_VERSION, TENSOR_PREFIX

GROUP = b"g"
MAC_BYTES = 32
MAX_PARTS = 4096
MAX_INDEX_BYTES = 1 << 20
TensorName = Annotated[str, Field(pattern=r"^[a-z_]{1,16}$")]


class Part(BaseModel):
    """Where one session's round sits in the group's fields."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    h: int = Field(ge=1, le=1 << 20, description="Its header's bytes.")
    t: dict[TensorName, int] = Field(max_length=4, description="Its tensors' bytes, by name.")


class GroupIndex(BaseModel):
    """A group entry's index (field `g`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    v: Literal[3] = PROTOCOL_VERSION
    kind: Literal["group"] = "group"
    parts: list[Part] = Field(min_length=1, max_length=MAX_PARTS)


def is_group(fields: object) -> bool:
    return isinstance(fields, dict) and GROUP in fields


def pack_group(rounds: list[dict[bytes, bytes]]) -> dict[bytes, bytes]:
    """One group entry from sealed rounds (each {h, t.<name>..., m})."""
    names = sorted({k for f in rounds for k in f if k.startswith(TENSOR_PREFIX)})
    parts = [
        Part(h=len(f[HEADER]), t={k[len(TENSOR_PREFIX) :].decode(): len(f[k]) for k in names if k in f}) for f in rounds
    ]
    out = {GROUP: GroupIndex(parts=parts).model_dump_json().encode(), HEADER: b"".join(f[HEADER] for f in rounds)}
    for name in names:
        out[name] = b"".join(f.get(name, b"") for f in rounds)
    out[MAC] = b"".join(f[MAC] for f in rounds)
    return out


def chunk_rounds(rounds: list[dict], cap: int) -> list[list[dict]]:
    """Consecutive runs of rounds whose fields add up to at most `cap` bytes, each packed as one group (a round
    larger alone goes alone: its tail answers it with why)."""
    out: list[list[dict]] = []
    size = cap + 1
    for fields in rounds:
        n = sum(len(k) + len(v) for k, v in fields.items())
        if size + n > cap:
            out.append([])
            size = 0
        out[-1].append(fields)
        size += n
    return out


def unpack_group(fields: dict, *, max_bytes: int) -> list[dict[bytes, bytes | memoryview]]:
    """Each part's own stream fields (its tensors' bytes as read-only views of the entry's: a group of 128 7B rounds
    is 8 MB, copied in about 5 ms); PacketError if the container is malformed (then no part is trusted: the
    lengths must add up exactly, field by field)."""
    total = sum(len(k) + len(v) for k, v in fields.items())
    if total > max_bytes:
        raise PacketError(f"group of {total} bytes exceeds the cap of {max_bytes}")
    raw = fields[GROUP]
    if len(raw) > MAX_INDEX_BYTES:
        raise PacketError(f"group index of {len(raw)} bytes exceeds the cap of {MAX_INDEX_BYTES}")
    index = _index(raw)
    names = sorted({TENSOR_PREFIX + n.encode() for p in index.parts for n in p.t})
    expected = {GROUP, HEADER, MAC, *names}
    if set(fields) != expected:
        extra = sorted(k.decode(errors="replace") if isinstance(k, bytes) else str(k) for k in set(fields) ^ expected)
        raise PacketError(f"group fields do not match its index: {extra}")
    sizes = {HEADER: [p.h for p in index.parts], MAC: [MAC_BYTES] * len(index.parts)}
    for name in names:
        sizes[name] = [p.t.get(name[len(TENSOR_PREFIX) :].decode(), 0) for p in index.parts]
    for name, lengths in sizes.items():
        if sum(lengths) != len(fields[name]):
            raise PacketError(
                f"group field {name.decode()!r} holds {len(fields[name])} bytes, its index {sum(lengths)}"
            )
    out: list[dict[bytes, bytes | memoryview]] = [{} for _ in index.parts]
    for name, lengths in sizes.items():
        view, at = memoryview(fields[name]), 0
        small = name in (HEADER, MAC)  # headers and MACs as bytes; tensors' bytes as views of the entry's, uncopied
        for i, n in enumerate(lengths):
            if small or name[len(TENSOR_PREFIX) :].decode() in index.parts[i].t:
                out[i][name] = bytes(view[at : at + n]) if small else view[at : at + n]
            at += n
    return out


def _index(raw: bytes) -> GroupIndex:
    try:
        head = json.loads(raw)
    except (ValueError, RecursionError):
        raise PacketError("group index is not JSON") from None
    if not isinstance(head, dict) or head.get("v") != PROTOCOL_VERSION:
        v = head.get("v") if isinstance(head, dict) else None
        raise PacketError(f"unsupported packet version {v!r}: this build speaks relay protocol {PROTOCOL_VERSION}")
    try:
        return GroupIndex.model_validate(head)
    except ValidationError as e:
        err = e.errors()[0]
        raise PacketError(f"invalid group index: {'.'.join(str(p) for p in err['loc'])}: {err['msg']}") from None
