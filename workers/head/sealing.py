"""What a head puts on the wire: how much of a long prompt a round carries (`part_tokens`), a computed round as a
frozen value (`Outbound`), and on a sender thread for a computed group each round's fields (its header and
tensors), then one group entry per tail stream, its parts MAC'd under their sessions' keys (`seal_rounds`;
schemas/groups.py `seal_group`; a round alone, `seal`)."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

import torch

from schemas.codec import Codec, TensorCodec
from schemas.groups import chunk_rounds, part_mac, seal_group
from schemas.macs import seal
from schemas.packets import MAC, RoundPacket, make_round, round_fields
from schemas.settings import RelaySettings

# A field this large goes to Redis as a view: redis-py then sends it as it is, rather than having hiredis copy it
# into one buffer with the command first (on this CPU an 8 MB XADD took 18 ms that way, 3.5 ms as a view)
VIEW_BYTES = 1 << 16
MAX_DRAFT_ROWS = 65  # a round's drafts (at most 64, schemas/packets.py) and its bonus row, beside its inputs


@dataclass(frozen=True, eq=False)
class Outbound:
    """A computed round as it goes on the wire, fixed when the loop made it (`Generation.outbound`): a sender thread
    reads this, never the generation. Its fields are made from the header made ahead (`made`: packet and JSON,
    `Generation.prepare`), else from the header's fields (`header`); `mac` is where the sender puts the MAC the
    round went out under (hex: what a tail's unsigned error reply echoes)."""

    sid: str
    stream: str  # the tail stream it goes to
    key: bytes  # its session's key
    tensors: dict[str, torch.Tensor]
    made: tuple[RoundPacket, bytes] | None = None
    header: dict | None = None
    codec: Codec = "raw"  # how its tensors go, where its header is not made yet (a header made names its own)
    hidden_codec: TensorCodec | None = None  # and its hidden rows, where not as `codec` (8-bit: `relay.wire`)
    mac: Future[str] = field(default_factory=Future)

    def fields(self) -> dict[bytes, bytes]:
        """Its unsealed stream fields: the tensors' bytes (copied from pinned memory) beside the header."""
        if self.made is not None:
            return round_fields(*self.made, self.tensors)
        assert self.header is not None
        return make_round(self.header, self.tensors, self.key, codec=self.codec, hidden_codec=self.hidden_codec)[1]

    @property
    def rows(self) -> int:
        """Hidden rows it carries (k + 1 for a round with k drafts: never the graphs' padding)."""
        return int(self.tensors["hidden"].shape[0])

    def again(self) -> Outbound:
        """The same round to send again (a full tail's wait is over), with a MAC of its own."""
        return replace(self, mac=Future())


def seal_rounds(rounds: Sequence[Outbound], relay: RelaySettings) -> tuple[list[tuple[str, dict]], list[Outbound]]:
    """On a sender's thread: these rounds as stream entries (`entries`), each round told the MAC it went out under;
    and the rounds whose fields could not be made (each fails alone, on the loop)."""
    made: list[tuple[Outbound, dict[bytes, bytes]]] = []
    bad: list[Outbound] = []
    for out in rounds:
        try:
            made.append((out, out.fields()))
        except Exception as e:
            out.mac.set_exception(e)
            bad.append(out)
    group, macs = entries([(out.stream, out.key, fields) for out, fields in made], relay)
    for (out, _), mac in zip(made, macs, strict=True):
        out.mac.set_result(mac.hex())
    return group, bad


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
