"""What tests need to speak the relay protocol as a head would: a head identity, a session key, sealed
rounds (schemas/packets.py) and, for a tail that checks its heads, the head's liveness key."""

from __future__ import annotations

import redis
import torch

from schemas.keys import Keys
from schemas.macs import seal
from schemas.packets import MAC, HeadRef, encode_round

TEST_HEAD = HeadRef(name="test-head", boot="0123456789abcdef", reply_timeout_s=15.0)
TEST_KEY = bytes(range(32))


def sealed_round(header: dict, tensors: dict[str, torch.Tensor], key: bytes = TEST_KEY) -> dict[bytes, bytes]:
    """The stream fields of a round (`header` without `head` gets TEST_HEAD), sealed with `key`."""
    return encode_round({"head": TEST_HEAD, **header}, tensors, key)[1]


def reseal(fields: dict[bytes, bytes], key: bytes = TEST_KEY) -> dict[bytes, bytes]:
    """The fields (changed after sealing) sealed again: a packet of the session's own head, however odd."""
    return seal(key, {k: v for k, v in fields.items() if k != MAC})


def announce(r: redis.Redis, names: Keys, head: HeadRef = TEST_HEAD, ttl_s: float = 600.0) -> None:
    """Set the head's liveness key as a running head does (workers/head/beacon.py)."""
    r.set(names.head(head.name), head.boot, px=int(ttl_s * 1000))
