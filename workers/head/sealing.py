"""What a head puts on the wire: how much of a long prompt a round carries (`part_tokens`), and on a sender thread
for a computed group each round's fields (its header and tensors), then one group entry per tail stream, its parts
MAC'd under their sessions' keys (schemas/groups.py `seal_group`; a round alone, `seal`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

from schemas.groups import chunk_rounds, part_mac, seal_group
from schemas.macs import seal
from schemas.packets import MAC
from schemas.settings import RelaySettings

# A field this large goes to Redis as a view: redis-py then sends it as it is, rather than having hiredis copy it
# into one buffer with the command first (on this CPU an 8 MB XADD took 18 ms that way, 3.5 ms as a view)
VIEW_BYTES = 1 << 16
MAX_DRAFT_ROWS = 65  # a round's drafts (at most 64, schemas/packets.py) and its bonus row, beside its inputs


# What this module reads of the loop's slots (workers/head/loop.py's `Slot`) and their rounds, as protocols: the loop
# and its rounds (workers/head/rounds.py) import this module, so it imports neither.
class Round(Protocol):
    """A computed round (`OpenRound`): its unsealed fields, and the MAC it last went out under."""

    fields: dict[bytes, bytes]
    mac: str


class Generation(Protocol):
    """A generation on the loop (`RoundLoop`): where its round goes, under which key, and the round."""

    @property
    def stream(self) -> str: ...

    @property
    def key(self) -> bytes: ...

    @property
    def round(self) -> Round | None: ...

    def packet(self) -> dict[bytes, bytes]: ...


class Sending(Protocol):
    """One of the loop's slots, as sealing reads it."""

    @property
    def gen(self) -> Generation: ...


S = TypeVar("S", bound=Sending)
Outbound = tuple[str, bytes, Round]  # (its tail stream, its session's key, its `OpenRound`, fields made)


def packets(slots: Sequence[S]) -> list[tuple[S, Outbound | Exception]]:
    """(slot, its round as it goes out, or what keeps its fields from being made: it fails alone) for each of the
    loop's slots (workers/head/loop.py's `Slot`)."""
    out: list[tuple[S, Outbound | Exception]] = []
    for slot in slots:
        try:
            slot.gen.packet()
            out.append((slot, outbound(slot)))
        except Exception as e:
            out.append((slot, e))
    return out


def outbound(slot: Sending) -> Outbound:
    """The slot's round as it stands now (its `fields` made: `RoundLoop.packet`), with its stream and key."""
    rnd = slot.gen.round
    assert rnd is not None  # the loop sends only a slot with a round computed (`RoundLoop.packet` asserts it too)
    return slot.gen.stream, slot.gen.key, rnd


def entries(
    rounds: Sequence[tuple[str, bytes, dict]], relay: RelaySettings
) -> tuple[list[tuple[str, dict]], list[bytes]]:
    """The stream entries for these (stream, session key, unsealed fields): one group entry per tail stream (one
    round goes alone), each under half a tail's packet cap (a tail refuses a group over it whole); and each
    round's MAC as sent, in the order given."""
    by_stream: dict[str, list[int]] = {}
    for i, (stream, _, _) in enumerate(rounds):
        by_stream.setdefault(stream, []).append(i)
    cap = relay.max_packet_bytes // 2 if relay.group_messages else 0
    out: list[tuple[str, dict]] = []
    macs = [b""] * len(rounds)
    for stream, group in by_stream.items():
        for chunk in chunk_rounds([rounds[i][2] for i in group], cap):
            picked = [group[j] for j in chunk]
            if len(picked) == 1:
                entry = seal(rounds[picked[0]][1], rounds[picked[0]][2])
                macs[picked[0]] = entry[MAC]
            else:
                entry = seal_group([(rounds[i][1], rounds[i][2]) for i in picked])
                for j, i in enumerate(picked):
                    macs[i] = part_mac(entry, j)
            out.append((stream, _viewed(entry)))
    return out, macs


def sealed(rounds: Sequence[Outbound], relay: RelaySettings) -> list[tuple[str, dict]]:
    """These rounds as stream entries (`entries`), each told the MAC it goes out under (`OpenRound.mac`: what a
    tail's unsigned error reply echoes). Each is the round object captured when it was made, not its generation's
    round by the time it is sealed (a timed-out one's replay may have replaced it)."""
    out, macs = entries([(stream, key, rnd.fields) for stream, key, rnd in rounds], relay)
    for (_, _, rnd), mac in zip(rounds, macs, strict=True):
        rnd.mac = mac.hex()
    return out


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
