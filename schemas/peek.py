"""Best-effort reads of a relay packet's header before (or after failing) validation: the session, round,
reply stream and version a worker needs to answer or dead-letter a packet that
schemas/packets.py has not (or could not) accept. Each returns None (or '') rather than raise."""

from __future__ import annotations

import json

from pydantic import TypeAdapter

from schemas.packets import HEADER, ReplyTo
from schemas.requests import SessionId

_SESSION_ID = TypeAdapter(SessionId)
_REPLY_TO = TypeAdapter(ReplyTo)


def raw_header(fields: object) -> str:
    """The packet's header as text, whatever it holds (for dead letters)."""
    try:
        raw = fields.get(HEADER, b"")  # type: ignore[attr-defined]
        return raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else str(raw)
    except Exception:
        return ""


def peek_session(fields: object) -> tuple[str | None, int | None]:
    """Best-effort (session_id, round_id) of a packet that failed validation, for error replies."""
    try:
        raw = json.loads(fields[HEADER])  # type: ignore[index]
        sid = _SESSION_ID.validate_python(raw["session_id"])
        rid = raw.get("round_id")
        return sid, rid if isinstance(rid, int) and not isinstance(rid, bool) and rid >= 0 else None
    except Exception:
        return None, None


def peek_reply_to(fields: object) -> str | None:
    """Best-effort `reply_to` of a round that failed validation (None unless it names a head's reply stream)."""
    try:
        return _REPLY_TO.validate_python(json.loads(fields[HEADER])["reply_to"])  # type: ignore[index]
    except Exception:
        return None


def peek_version(fields: object) -> object:
    """Best-effort `v` of a packet's header (None when it has none)."""
    try:
        raw = json.loads(fields[HEADER])  # type: ignore[index]
        return raw.get("v") if isinstance(raw, dict) else None
    except Exception:
        return None
