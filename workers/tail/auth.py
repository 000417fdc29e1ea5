"""A tail's first look at a batch of head packets: each header validated and the key its MAC must verify under
(the session's, as this tail holds it, or for a round that opens a session the key it carries), then every MAC
of the batch checked, side by side on `relay.mac_threads` threads where they hash much (hashlib lets go of the
interpreter lock over a round's hidden states, so rounds that came alone need not be hashed one after another on
the tail's loop; a group's parts hash only their headers, its tensors hashed once on unpacking), a contiguous
share of the batch a thread (workers/shares.py). Nothing here touches a session: a packet whose MAC does not
verify is refused before anything else reads it."""

from __future__ import annotations

from collections.abc import Sequence

from schemas.errors import ForgedPacket, SessionError
from schemas.macs import authentic, mac_bytes
from schemas.packets import ClosePacket, Oversized, RoundPacket, decode_head_header
from schemas.settings import RelaySettings
from workers.shares import Shares
from workers.tail.sessions import SessionStore

# (header, the session's key, why it is refused if over the cap): a packet whose MAC verified under that key
Authenticated = tuple[RoundPacket | ClosePacket, bytes | None, Oversized | None]


def _verify(signed: Sequence[tuple[dict, bytes]]) -> list[bool]:
    """Whether each packet's MAC verifies under its key."""
    return [authentic(key, fields) for fields, key in signed]


class Authenticator:
    """Checks packets against the sessions a tail holds (see the module docstring)."""

    def __init__(self, sessions: SessionStore, caps: RelaySettings) -> None:
        self.sessions, self.caps = sessions, caps
        self.shares = Shares(caps.mac_threads, "tail-mac")  # its loop's unpacking uses them too

    def check(self, entries: list[dict]) -> list[Authenticated | Exception]:
        """For each entry, its `Authenticated` once its MAC verifies, or the error that refuses it."""
        heads: list[Authenticated | Exception] = []
        for fields in entries:
            try:
                heads.append(self.header_and_key(fields))
            except Exception as e:  # kept without its traceback: its frames hold the entry (a cycle through
                heads.append(e.with_traceback(None))  # this list, freed only by the GC: 4 huge entries piled up)
        signed = [
            (fields, h[1]) for fields, h in zip(entries, heads, strict=True) if not isinstance(h, Exception) and h[1]
        ]
        oks = self.shares.map(_verify, signed, sum(mac_bytes(fields) for fields, _ in signed))
        verified = {id(f): ok for (f, _), ok in zip(signed, oks, strict=True)}
        out: list[Authenticated | Exception] = []
        for fields, h in zip(entries, heads, strict=True):
            if not isinstance(h, Exception) and h[1] and not verified[id(fields)]:
                h = ForgedPacket(f"the MAC of a packet for session {h[0].session_id} does not verify")
            out.append(h)
        return out

    def header_and_key(self, fields: dict) -> Authenticated:
        """The packet's header, the key its MAC must verify under and, for a packet over the cap, why it is
        refused. A close for a session not held comes back with no key (nothing to check, nothing to touch)."""
        oversized = None
        try:
            msg = decode_head_header(fields, caps=self.caps)
        except Oversized as e:
            msg, oversized = decode_head_header(fields, caps=self.caps, capped=False), e
        held = self.sessions.peek(msg.session_id)
        if held is not None:
            return msg, held.key, oversized
        if isinstance(msg, RoundPacket) and msg.key is not None:
            return msg, bytes.fromhex(msg.key), oversized
        if isinstance(msg, ClosePacket):
            return msg, None, None
        raise SessionError(f"unknown session {msg.session_id} (expired, or this tail restarted)")
