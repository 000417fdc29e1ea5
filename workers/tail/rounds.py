"""A tail's rounds between decoding and the verdict: what a checked round carries (`Prepared`), how the drafts
are judged against the target's logits (greedy, or rejection sampling; a replay first checks it reproduces
its last committed token), and what a refused packet leaves for the dead-letter stream."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from schemas.errors import SessionError
from schemas.packets import DeadLetterRecord, RoundPacket, raw_header
from workers.speculative.sampling import decode_q, round_generator, warp
from workers.speculative.verify import verify_greedy, verify_sampling
from workers.tail.sessions import TailSession


@dataclass
class Prepared:
    """A decoded, checked round waiting for the batched forward."""

    packet: RoundPacket
    sess: TailSession
    key: bytes
    hidden: torch.Tensor
    tensors: dict[str, torch.Tensor]
    fields: dict


@dataclass
class DeadLetter:
    """A refused packet and why, until it is written to the dead-letter stream."""

    fields: dict
    reason: str
    session_id: str | None
    round_id: int | None

    def record(self, stream: bytes | str, entry_id: bytes, tail_id: str) -> dict:
        return DeadLetterRecord(
            stream=stream.decode() if isinstance(stream, bytes) else stream,
            entry_id=entry_id.decode(),
            reason=self.reason,
            session_id=self.session_id,
            round_id=self.round_id,
            tail_id=tail_id,
            header=raw_header(self.fields),
            at=time.time(),
        ).fields()


def rewind(p: Prepared) -> None:
    """Back to where the round started (a failed batched forward may have written part of it)."""
    if p.sess.cache.length > p.packet.start_pos:
        p.sess.cache.crop(p.packet.start_pos)


def check_replay(p: RoundPacket, logits: torch.Tensor) -> None:
    """A replayed session must predict its own last committed token (greedy: as the argmax, up to a
    rounding-size tie; sampled: with nonzero probability), or this tail is not computing what the
    first one did."""
    last = p.input_ids[-1]
    if p.sampling.greedy:
        top = float(logits.max())
        ok = top - float(logits[last]) <= 1e-2 * max(1.0, abs(top))
    else:
        ok = float(warp(logits[None], p.sampling)[0, last]) > 0
    if not ok:
        raise SessionError(f"replay of session {p.session_id} does not reproduce its last committed token")


def judge(prep: Prepared, logits: torch.Tensor) -> tuple[int, int]:
    """(drafts accepted, the correction or bonus token) of one round, from its rows' logits."""
    p = prep.packet
    if p.replay:
        check_replay(p, logits[0])
        logits = logits[1:]
    if p.sampling.greedy:
        return verify_greedy(logits, p.draft_ids)
    drafts = torch.tensor(p.draft_ids, dtype=torch.long, device=logits.device)
    probs = warp(logits, p.sampling)
    q = decode_q(p.q_kind, drafts, prep.tensors, probs.shape[-1])
    gen = round_generator(p.sampling.seed or 0, p.round_id, "verify", logits.device)
    return verify_sampling(probs, drafts, q, gen)
