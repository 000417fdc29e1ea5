"""What a head puts on the wire: how much of a long prompt a round carries (`part_tokens`), and on a sender thread
for a computed group each round sealed (its header, tensors and MAC), then one group entry per tail stream
(schemas/groups.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from schemas.groups import chunk_rounds, pack_group
from schemas.settings import RelaySettings

# A field this large goes to Redis as a view: redis-py then sends it as it is, rather than having hiredis copy it
# into one buffer with the command first (on this CPU an 8 MB XADD took 18 ms that way, 3.5 ms as a view)
VIEW_BYTES = 1 << 16
MAX_DRAFT_ROWS = 65  # a round's drafts (at most 64, schemas/packets.py) and its bonus row, beside its inputs


def packets(slots: Sequence[Any]) -> list[tuple[Any, str, dict | Exception]]:
    """(slot, its tail stream, its round's sealed stream fields, or what keeps it from being sealed: it fails
    alone) for each of the loop's slots (workers/head/loop.py's `Slot`)."""
    out: list[tuple[Any, str, dict | Exception]] = []
    for slot in slots:
        try:
            out.append((slot, slot.gen.stream, slot.gen.packet()))
        except Exception as e:
            out.append((slot, slot.gen.stream, e))
    return out


def hidden_bytes(slots: Sequence[Any]) -> int:
    """The bytes of hidden states these slots' computed rounds carry (what sealing them hashes, mostly)."""
    rounds = (slot.gen.round for slot in slots)
    return sum(h.numel() * h.element_size() for r in rounds if r is not None and (h := r.work.hidden) is not None)


def entries(rounds: Sequence[tuple[str, dict]], relay: RelaySettings) -> list[tuple[str, dict]]:
    """The stream entries for these (stream, sealed fields): one group entry per tail stream (one round goes
    alone), each under half a tail's packet cap (a tail refuses a group over it whole)."""
    by_stream: dict[str, list[dict]] = {}
    for stream, fields in rounds:
        by_stream.setdefault(stream, []).append(fields)
    if not relay.group_messages:
        return [(stream, _viewed(fields)) for stream, group in by_stream.items() for fields in group]
    cap = relay.max_packet_bytes // 2
    return [
        (stream, _viewed(pack_group(chunk) if len(chunk) > 1 else chunk[0]))
        for stream, group in by_stream.items()
        for chunk in chunk_rounds(group, cap)
    ]


def _viewed(fields: dict) -> dict:
    """The entry's fields, its large values as memoryviews (sent uncopied, VIEW_BYTES)."""
    return {k: memoryview(v) if isinstance(v, bytes) and len(v) > VIEW_BYTES else v for k, v in fields.items()}


def part_tokens(pending: int, row_bytes: int, hidden: int, relay: RelaySettings) -> int:
    """How many of `pending` uncached committed tokens the next round carries: all where their hidden rows (and a
    round's drafts) fit half a tail's packet cap, its tensor cap and their ids its header cap, else as many as do,
    the rest in later rounds of their own (a long prompt or replay in parts), leaving at least two for the last (a
    replay checks its last two)."""
    rows = min(relay.max_packet_bytes // 2 // max(row_bytes, 1), relay.max_tensor_elements // max(hidden, 1))
    rows = min(rows, relay.max_header_bytes // 16)  # its token ids in the header's JSON (at most 16 bytes each)
    cap = max(rows - MAX_DRAFT_ROWS, 2)
    return pending if pending <= cap else min(cap, pending - 2)
