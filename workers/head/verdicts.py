"""What a head checks of a tail's verdict before it commits anything: the tail is another process (and on a
no-ACL Redis anyone may write its reply stream), so a verdict that is not a possible answer to the round sent
is refused, never committed (workers/head/rounds.py `RoundLoop._reply_to`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas.dead_letters import dead_letter
from schemas.packets import ErrorReply, Verdict


@dataclass
class Refusals:
    """One generation's account of its reply stream: where its replies come (`stream`, the head's own reply stream,
    workers/head/beacon.py), the entry it took last (`entry_id`, set by the loop), and the entries it refused:
    all counted, the first `keep` kept as dead-letter records for the loop to send (a flood is counted, not
    stored; the head's cap per source stream, relay_broker/budgets.py, holds over them too)."""

    stream: str
    keep: int
    entry_id: bytes = b""
    refused: int = 0
    _dead: list[dict] = field(default_factory=list, repr=False)

    def refuse(self, record: dict) -> None:
        """Count a refused entry; keep its dead-letter record (`refusal`) while fewer than `keep` are kept."""
        self.refused += 1
        if self.refused <= self.keep:
            self._dead.append(record)

    def take_dead(self) -> list[dict]:
        """The records kept so far (the caller sends them)."""
        dead, self._dead = self._dead, []
        return dead


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
