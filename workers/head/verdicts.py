"""What a head checks of a tail's verdict before it commits anything: the tail is another process (and on a
no-ACL Redis anyone may write its reply stream), so a verdict that is not a possible answer to the round sent
is refused, never committed (`check_reply`, called by workers/head/generation.py `Generation.take`)."""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from schemas.dead_letters import dead_letter
from schemas.errors import PacketError
from schemas.macs import authentic
from schemas.packets import ErrorReply, Verdict, decode_tail_message
from schemas.settings import RelaySettings


@dataclass(frozen=True)
class Expected:
    """What the round in flight allows a reply to be: its session and round, the MAC it went out under (what an
    unsigned "replay it" must echo; "" until its sender sealed it), its drafts, the tokens it may still commit, and
    whether it is a part of a long prompt (commits nothing)."""

    key: bytes
    sid: str
    rid: int
    mac: str
    drafts: list[int]
    remaining: int
    vocab_size: int
    part: bool


@dataclass(frozen=True)
class Refused:
    """Why a reply-stream entry is refused, and what it said (None: it did not decode)."""

    reason: str
    msg: Verdict | ErrorReply | None = None


def check_reply(fields: dict, want: Expected, caps: RelaySettings) -> Verdict | ErrorReply | Refused | None:
    """The entry as the round's reply; None where it is stale (an earlier round's: dropped); else why it is refused.
    A reply counts only if its MAC verifies under the session's key, or it is an unsigned "replay it" that echoes
    this round's MAC: a tail that lost the session has no key to sign with."""
    try:
        msg = decode_tail_message(fields, caps=caps)
    except PacketError as e:
        return Refused(str(e))
    if not authentic(want.key, fields, reply=True):
        echoed = isinstance(msg, ErrorReply) and msg.echo is not None and hmac.compare_digest(msg.echo, want.mac)
        if not echoed or not want.mac:
            return Refused("its MAC does not verify under the session's key", msg)
    if msg.session_id != want.sid:
        return Refused(f"a reply naming session {msg.session_id}", msg)
    if msg.round_id is None:  # never final, never a replay: a reply must say which round it answers
        return Refused("an error reply naming no round", msg)
    if msg.round_id < want.rid:
        return None
    if msg.round_id > want.rid:
        return Refused(f"a reply to round {msg.round_id}, which was not sent", msg)
    if isinstance(msg, Verdict):
        problem = verdict_problem(msg, want.drafts, want.remaining, want.vocab_size, want.part)
        if problem:
            return Refused(problem, msg)
    return msg


@dataclass
class Refusals:
    """One generation's count of the reply-stream entries it refused: all counted, the first `keep` turned into
    dead-letter records for the loop to send (a flood is counted, not stored; the head's cap per source stream,
    relay_broker/budgets.py, holds over them too)."""

    keep: int
    refused: int = 0

    def refuse(self, record: dict) -> dict | None:
        """Count a refused entry; its dead-letter record (`refusal`) while fewer than `keep` went, else None."""
        self.refused += 1
        return record if self.refused <= self.keep else None


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
