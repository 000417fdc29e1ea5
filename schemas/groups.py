"""Group messages: one stream entry carries the rounds of every session of one of a head's groups.

Each session's round is still its own message under its own session's key (schemas/packets.py); a group entry
packs them, so a tail reads, validates and acks one entry per group and a head publishes one:

  g           the index (JSON, `GroupIndex`): for each part, its header's byte length and each tensor's
  h           every part's header, back to back
  t.<name>    every part's tensor `name`, back to back: `t.hidden` is one [sum of rows, hidden] tensor
  m           every part's MAC (32 bytes each), back to back

`unpack_group` gives back each part's own stream fields, so a tail checks, dedups, answers and dead-letters each
session as if it had come alone: a bad part fails its own session only. A stage that forwards a group rather
than verifying it can pass it on unopened.

**One digest for the group's tensors** (`seal_group`). A part's MAC, under its session's key, covers its header and
its binding (`DIGEST`): the SHA-256 of every tensor field of the group and where the part's own tensors sit in them.
`unpack_group` computes that binding from the bytes it was given, so a part's MAC verifies only if the group's
tensors are, to the byte, what the head sealed. Hashing a group's megabytes once, rather than one HMAC a session,
lets go of the interpreter lock once: a head's sender thread waited for it again after every session's rows (22-26
ms a group of 64 under load in run 115, docs/runs/journal.md; bench/mac_cost.py times both). Tampered tensor bytes
fail every part of the group; a part whose header is bad, or whose MAC is, still fails alone. Groups without tensors
(a tail's replies) keep each part's own MAC over its header (`pack_group`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from schemas.errors import PacketError
from schemas.macs import DIGEST, Binding, seal
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

    v: Literal[4] = PROTOCOL_VERSION
    kind: Literal["group"] = "group"
    parts: list[Part] = Field(min_length=1, max_length=MAX_PARTS)


def is_group(fields: object) -> bool:
    return isinstance(fields, dict) and GROUP in fields


def rounds_in(fields: dict) -> int:
    """How many rounds an entry says it carries (a group: one MAC each), unchecked: a count to batch by, never trusted
    further (`unpack_group` checks the group)."""
    mac = fields.get(MAC, b"") if is_group(fields) else b""
    return min(max(len(mac) // MAC_BYTES, 1), MAX_PARTS) if isinstance(mac, bytes | memoryview) else 1


def entry_parts(fields: dict, *, max_bytes: int) -> list[dict]:
    """A stream entry's messages: a group's parts (`unpack_group`), or the entry alone; PacketError for a malformed
    group, or for an entry alone that carries a part's binding (DIGEST, which only unpacking sets: a MAC over it
    would leave the entry's own tensors unchecked)."""
    if is_group(fields):
        return unpack_group(fields, max_bytes=max_bytes)
    if DIGEST in fields:
        raise PacketError(f"field {DIGEST.decode()!r} is a group part's, not an entry's")
    return [fields]


def seal_group(rounds: Sequence[tuple[bytes, dict[bytes, bytes]]]) -> dict[bytes, bytes]:
    """One group entry from unsealed rounds, (session key, {h, t.<name>...}) each: each part MAC'd under its key
    over its header and its binding to the group's tensors (see the module docstring)."""
    packed = pack_group([{**fields, MAC: bytes(MAC_BYTES)} for _, fields in rounds])
    names = sorted(k for k in packed if k.startswith(TENSOR_PREFIX))
    if not names:  # nothing to bind (as `unpack_group` then sets no DIGEST): each part MAC'd over its own fields
        packed[MAC] = b"".join(seal(key, f)[MAC] for key, f in rounds)
        return packed
    bindings = _bindings(packed, names, [{n: len(f[n]) for n in names if n in f} for _, f in rounds])
    macs = (seal(key, {HEADER: f[HEADER], DIGEST: b})[MAC] for (key, f), b in zip(rounds, bindings, strict=True))
    packed[MAC] = b"".join(macs)
    return packed


def part_mac(fields: dict[bytes, bytes], i: int) -> bytes:
    """The MAC of a group entry's i-th part."""
    return bytes(fields[MAC][i * MAC_BYTES : (i + 1) * MAC_BYTES])


def _bindings(fields: dict, names: list[bytes], parts: list[dict[bytes, int]]) -> list[Binding]:
    """Each part's DIGEST: the SHA-256 of the group's tensor fields `names` (in order, each length-prefixed), then
    for each of the part's own tensors (name: bytes) its name, offset and length in its field. hashlib lets go of
    the interpreter lock over each field's bytes."""
    h = hashlib.sha256()
    for name in names:
        h.update(len(name).to_bytes(4, "big") + name + len(fields[name]).to_bytes(8, "big"))
        h.update(fields[name])
    digest, at, out = h.digest(), dict.fromkeys(names, 0), []
    for own in parts:
        spans = b""
        for name, n in sorted(own.items()):
            spans += len(name).to_bytes(1, "big") + name + at[name].to_bytes(8, "big") + n.to_bytes(8, "big")
            at[name] += n
        out.append(Binding(digest + spans))
    return out


def pack_group(rounds: list[dict[bytes, bytes]]) -> dict[bytes, bytes]:
    """One group entry from rounds as they are (each {h, t.<name>..., m}): the container alone. Parts with tensors
    must be MAC'd over their binding (`seal_group`); parts without (replies) each under its own MAC (`seal`)."""
    names = sorted({k for f in rounds for k in f if k.startswith(TENSOR_PREFIX)})
    parts = [
        Part(h=len(f[HEADER]), t={k[len(TENSOR_PREFIX) :].decode(): len(f[k]) for k in names if k in f}) for f in rounds
    ]
    out = {GROUP: GroupIndex(parts=parts).model_dump_json().encode(), HEADER: b"".join(f[HEADER] for f in rounds)}
    for name in names:
        out[name] = b"".join(f.get(name, b"") for f in rounds)
    out[MAC] = b"".join(f[MAC] for f in rounds)
    return out


def chunk_rounds(rounds: list[dict], cap: int) -> list[list[int]]:
    """The indices of consecutive runs of rounds whose fields (and MACs) add up to at most `cap` bytes, each packed
    as one group (a round larger alone goes alone: its tail answers it with why; cap 0: every round alone)."""
    out: list[list[int]] = []
    size = cap + 1
    for i, fields in enumerate(rounds):
        n = sum(len(k) + len(v) for k, v in fields.items() if k != MAC) + MAC_BYTES
        if size + n > cap:
            out.append([])
            size = 0
        out[-1].append(i)
        size += n
    return out


def unpack_group(fields: dict, *, max_bytes: int) -> list[dict[bytes, bytes | memoryview]]:
    """Each part's own stream fields (its tensors' bytes as read-only views of the entry's: a group of 128 7B rounds
    is 8 MB, copied in about 5 ms) and, in a group with tensors, its binding to them (DIGEST, see the module
    docstring); PacketError if the container is malformed (then no part is trusted: the lengths must add up
    exactly, field by field)."""
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
    if names:
        own = [
            {n: sizes[n][i] for n in names if n[len(TENSOR_PREFIX) :].decode() in p.t}
            for i, p in enumerate(index.parts)
        ]
        for part, binding in zip(out, _bindings(fields, names, own), strict=True):
            part[DIGEST] = binding
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
