"""Per-session keys and MACs of relay packets (schemas/packets.py), and their stream field names.

Every head -> tail round and close and every tail -> head reply carries `m`, an HMAC-SHA256 under its session's
key of its other fields in name order, each length-prefixed, with the direction first (a MAC of one direction never
passes for the other). A group entry's part (schemas/groups.py) is MAC'd over its header and its binding to the
group's tensors (`DIGEST`, a `Binding` only unpacking makes), which stands for its tensors' bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

HEADER = b"h"
TENSOR_PREFIX = b"t."
MAC = b"m"
DIGEST = b"d"  # a group's part: its binding to the group's tensors (schemas/groups.py), set on unpacking, never sent
KEY_BYTES = 32
_REQUEST, _REPLY = b"shardflow-round\x00", b"shardflow-reply\x00"


class Binding(bytes):
    """A DIGEST value as schemas/groups.py computed it; an entry's own field is plain bytes, and never binds."""


def session_key() -> bytes:
    """A new session's key (random, KEY_BYTES long)."""
    return secrets.token_bytes(KEY_BYTES)


def _mac(key: bytes, direction: bytes, fields: dict) -> bytes:
    """HMAC-SHA256 over the header and every tensor field (in name order), each length-prefixed; for a group's part
    (one with DIGEST) over its header and DIGEST, which binds its tensors' bytes (schemas/groups.py)."""
    mac = hmac.new(key, direction, hashlib.sha256)
    for name in _maced(fields):
        value = fields[name]
        mac.update(len(name).to_bytes(4, "big") + name + len(value).to_bytes(8, "big"))
        mac.update(value)
    return mac.digest()


def mac_bytes(fields: dict) -> int:  # the bytes `_mac` hashes for these fields
    return sum(len(fields[k]) for k in _maced(fields))


def _maced(fields: dict) -> list:
    """The names of the fields a MAC covers, in order (a group's part: not its tensors, which DIGEST binds)."""
    bound = isinstance(fields.get(DIGEST), Binding)
    return sorted(k for k in fields if k != MAC and not (bound and k.startswith(TENSOR_PREFIX)))


def seal(key: bytes, fields: dict[bytes, bytes], *, reply: bool = False) -> dict[bytes, bytes]:
    """The stream fields with their MAC (`m`) under the session's key."""
    return {**fields, MAC: _mac(key, _REPLY if reply else _REQUEST, fields)}


def authentic(key: bytes, fields: dict, *, reply: bool = False) -> bool:
    """Whether the entry's MAC verifies under `key` (constant time)."""
    got = fields.get(MAC) if isinstance(fields, dict) else None
    if not isinstance(got, bytes) or len(got) != hashlib.sha256().digest_size:
        return False
    if not all(isinstance(k, bytes) and isinstance(v, bytes | memoryview) for k, v in fields.items()):
        return False
    if DIGEST in fields and not isinstance(fields[DIGEST], Binding):  # an entry's own "binding": its tensors unchecked
        return False
    return hmac.compare_digest(got, _mac(key, _REPLY if reply else _REQUEST, fields))


def mac_hex(fields: dict) -> str:
    """The entry's MAC as hex (what an unsigned error reply echoes); '' when it has none."""
    got = fields.get(MAC) if isinstance(fields, dict) else None
    return got.hex() if isinstance(got, bytes) else ""
