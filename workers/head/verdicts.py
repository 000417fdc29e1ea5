"""What a head checks of a tail's verdict before it commits anything: the tail is another process (and on a
no-ACL Redis anyone may write its reply stream), so a verdict that is not a possible answer to the round sent
is refused, never committed (workers/head/rounds.py `RoundLoop._reply_to`)."""

from __future__ import annotations

from schemas.dead_letters import dead_letter
from schemas.packets import ErrorReply, Verdict


def refusal(
    stream: str, entry_id: bytes, reason: str, sid: str, msg: Verdict | ErrorReply | None, fields: dict
) -> dict:
    """The dead-letter record of a reply-stream entry the head refused (the fields to publish)."""
    return dead_letter(
        stream,
        entry_id,
        f"head refused a reply: {reason}",
        fields,
        session_id=sid,
        round_id=msg.round_id if msg is not None else None,
        tail_id=msg.tail_id if msg is not None else "",
        refused_by="head",
    )


def verdict_problem(v: Verdict, drafts: list[int], remaining: int, vocab_size: int, part: bool = False) -> str | None:
    """Why a verdict cannot be this round's answer (None if it can): the tail accepts a prefix of the drafts
    and commits it plus one token of its own, cut at a stop, never past `remaining` tokens; a part of a prompt
    (`part`: more of it to come) commits nothing."""
    if part:
        empty = v.accepted == 0 and not v.tokens and v.next_token is None and v.finish_reason is None
        return None if empty else f"verdict for round {v.round_id}, a part of a prompt, commits something"
    if max(v.tokens + [v.next_token or 0]) >= vocab_size:
        return f"verdict for round {v.round_id} holds token ids beyond the vocabulary"
    kept = min(v.accepted, len(v.tokens))
    if v.accepted > len(drafts) or v.tokens[:kept] != drafts[:kept] or len(v.tokens) > min(v.accepted + 1, remaining):
        return f"verdict for round {v.round_id} does not match the drafts sent"
    if v.finish_reason is None and v.next_token is None:
        return f"verdict for round {v.round_id} has neither a next token nor a finish"
    if v.finish_reason is None and v.tokens != drafts[: v.accepted] + [v.next_token]:
        return f"verdict for round {v.round_id} does not commit its accepted drafts and next token"
    return None
