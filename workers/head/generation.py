"""One generation on the head: a `Generation` is a request from its submission to its result, with one state
(`Phase`), stepped only by the head's loop thread (workers/head/loop.py; entry: runtime.generate).

    WAITING --seated (workers/head/schedule.py)--> READY --computed and sent--> IN_FLIGHT
    IN_FLIGHT --verdict--> READY (or its end) · --"busy" from a full tail--> BUSY --due--> IN_FLIGHT
    IN_FLIGHT --error reply or silence--> READY (a replay onto a live tail)
    any --result, error, timeout or cancel--> DONE (its cache slots freed, its Future resolved)

What leaves the loop thread is data: a round goes to a sender thread as a frozen `Outbound`
(workers/head/sealing.py), a refused reply comes back from `take` as a dead-letter record for the loop to send.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import redis
import torch

from schemas.errors import NonFiniteError, RemoteError, ReplyTimeout
from schemas.keys import Keys
from schemas.macs import session_key
from schemas.packets import ClosePacket, ErrorReply, RoundPacket, Verdict, encode_message, round_header
from schemas.requests import FinishReason, GenerationRequest, GenerationResult, RoundTimings
from schemas.tensors import DTYPE_NAMES, TensorMeta, tensor_meta
from workers.head.core import Runtime
from workers.head.drafts import HeadWork
from workers.head.round_times import add_round
from workers.head.sealing import Outbound, part_tokens
from workers.head.verdicts import Expected, Refusals, Refused, check_reply, refusal
from workers.speculative.adaptive import DraftLength
from workers.speculative.drafters import Draft, NoFreeSlot
from workers.speculative.sampling import encode_q, round_generator
from workers.speculative.stopping import StopStrings

log = logging.getLogger("shardflow.head")
MAX_HELD = 64  # reply-stream entries kept for a generation between its rounds (a flood beyond is dropped unread)


class Phase(enum.Enum):
    """Where a generation is (the module docstring draws the moves)."""

    WAITING = "waiting"  # submitted: no cache slot of its length free yet
    READY = "ready"  # its next round is to be computed
    IN_FLIGHT = "in_flight"  # its round is on the wire: waiting for the verdict until `due`
    BUSY = "busy"  # a full tail refused its new session: the same round goes again at `due`
    DONE = "done"  # ended: its slots freed, its Future resolved


class StepLoop(Protocol):
    """What a generation needs of the head's step loop (workers/head/loop.py `HeadLoop`): to be run on it."""

    def submit(self, gen: Generation, timeout_s: float | None = None) -> Future[GenerationResult]: ...


class GenerationRuntime(Runtime, Protocol):
    """What a generation needs of its runtime (workers/head/runtime.py `HeadRuntime`): the loop's needs and the
    step loop it runs on."""

    def loop_for(self, r: redis.Redis) -> StepLoop:
        """The step loop that runs the head's generations on connection `r`."""
        ...


@dataclass
class OpenRound:
    """A round from its work to its verdict."""

    rid: int
    start: int
    remaining: int
    work: HeadWork
    header: tuple[tuple, RoundPacket, bytes] | None = None  # (what it was made from, packet, JSON): `prepare`
    out: Outbound | None = None  # as it went out last (sent again as it is to a full tail)
    sent_at: float = 0.0
    sent_wall: float = 0.0  # time.time() when sent (beside the tail's wall-clock timings)
    busy: int = 0  # "busy" answers so far (the resend waits double each time)
    more: int = 0  # committed tokens left for later rounds: this one is a part of a long prompt, committing nothing


class Generation:
    """One request on the head, from its submission to its result: its phase, caches, committed tokens and
    stats. The head's loop (workers/head/loop.py) drives it: `seat` and `begin` (workers/head/schedule.py),
    `next_work` (batched with other generations'), `outbound`, `sent`, then `take` for each entry of its reply
    stream (or `timed_out`), and at its end `release` and `goodbye`."""

    def __init__(
        self,
        *,
        req: GenerationRequest,
        runtime: GenerationRuntime,
        r: redis.Redis,
        names: Keys,
        session_id: str,
        prompt: list[int],
        on_tokens: Callable[[list[int], list[int]], None] | None,
        reply_timeout_s: float | None,
        resume: list[int] | None = None,
    ) -> None:
        self.req, self.rt, self.r, self.names, self.sid = req, runtime, r, names, session_id
        self.on_tokens, self.reply_timeout_s = on_tokens, reply_timeout_s
        self.phase = Phase.WAITING
        self.future: Future[GenerationResult] = Future()  # its result, or what failed it
        self.deadline: float | None = None  # the job's timeout (monotonic), set when submitted
        self.due = 0.0  # IN_FLIGHT: when its verdict is late; BUSY: when its round goes again
        self.since = time.monotonic()  # when it last became READY
        self.held: list[tuple[bytes, dict]] = []  # reply-stream entries (id, fields) that came while it was READY
        self.generated: list[int] = list(resume or [])  # a checkpoint's tokens: the first round replays them
        self.prompt, self.committed = list(prompt), list(prompt) + self.generated
        self.pending = list(self.committed)
        self.resumed, self.replays = len(self.generated), 0
        self.replay_next = bool(self.generated)
        self.need = len(prompt) + req.max_new_tokens + req.draft.k + 1  # positions its caches may hold
        self.hops = runtime.routes.route(r, names)  # where its rounds go: middle stages, the tail last
        self.key = session_key()  # MACs every round and reply of this generation (schemas/packets.py)
        self.head = runtime.beacons.ensure(r, names)  # announced before the first round: tails see it alive
        self.tail_closed = False  # a final verdict came: the tail dropped the session (no close packet to send)
        self.settings = runtime.settings
        self.refusals = Refusals(self.settings.relay.reply_dead_letters_max)
        cfg = runtime.shard.config  # read once: a config's attributes are slow to read, and rounds need these
        self.vocab_size, self.hidden_size = cfg.vocab_size, cfg.hidden_size
        self.row_bytes = self.hidden_size * runtime.shard.dtype.itemsize  # a hidden row on the wire
        self.stops = StopStrings(runtime.tokenizer, req.stop)
        self.t = RoundTimings()
        self.rounds = self.parts = self.drafted = self.accepted = 0  # parts: of a long prompt, not rounds
        self.length = DraftLength(req.draft.k)  # this generation's draft length (adapted if asked)
        self.reply_to: str | None = None  # its head's reply stream (`reply:REPLY_TO`), set by the loop
        self.reply_stream = ""  # that stream's key (what its dead letters name)
        self.round: OpenRound | None = None  # the round computed and sent, until its verdict
        self.finish: FinishReason | None = None
        self.started = time.perf_counter()

    @property
    def pinned(self) -> bool:
        """Whether its rounds go to the workers that hold its session (after its first verdict), not shared streams."""
        return "@" in self.hops[-1]

    @property
    def stream(self) -> str:
        """The stream its rounds go to first (a middle stage's, or the tail's)."""
        return self.names.hop_stream(self.hops[0])

    # --- the steps the head's loop (workers/head/loop.py) drives: no method blocks -------------------------
    # --- the steps the head's loop (workers/head/loop.py) drives: no method blocks -------------------------
    def seat(self, overflow: bool = True) -> bool:
        """Take its cache slot (a short one where its tokens and drafts fit) and its drafter's; False, holding nothing,
        where no free slot fits and not `overflow` (a spare pool beyond the plan): the loop tries again later."""
        cache = self.rt.engine.acquire(overflow=overflow, need=self.need)
        if cache is None:
            return False
        try:
            self.drafter = self.rt.drafter_for(self.req, len(self.prompt), overflow)
        except BaseException as e:
            self.rt.engine.release(cache)
            if isinstance(e, NoFreeSlot):  # the draft model's slots of its length are taken: seated later
                return False
            raise
        self.cache, self.phase = cache, Phase.READY
        return True

    def begin(self) -> FinishReason | None:
        """Start the clock; a finish if the checkpoint already ends the generation."""
        self.started, self.since = time.perf_counter(), time.monotonic()
        self.finish = self._already_finished()
        return self.finish

    def next_work(self) -> HeadWork:
        """This round's draft and lower-shard work (round ids go on past a checkpoint: no reused seeds on resume)."""
        rid = self.resumed + self.rounds + self.parts
        remaining = self.req.max_new_tokens - len(self.generated)
        start = len(self.committed) - len(self.pending)
        n = part_tokens(len(self.pending), self.row_bytes, self.hidden_size, self.settings.relay)
        more = len(self.pending) - n  # past the packet cap: this round carries a part, and drafts nothing
        k = min(self.length.k, remaining - 1) if self.drafter is not None and not more else 0
        seeds = self.resumed + self.rounds  # a long prompt's parts draw nothing: they take no seeds (`seed_round`)
        gen = round_generator(self.req.sampling.seed or 0, seeds, "draft", self.drafter.device) if k else None
        work = HeadWork(self.drafter, self.committed, k, self.req.sampling, gen, self.cache, self.pending[:n], start)
        work.route = self.stream
        self.round = OpenRound(rid, start, remaining, work, more=more)
        return work

    def prepare(self) -> None:
        """While the device computes the round's hidden states (its drafts known): its header, validated and
        serialized ahead of `outbound` (its sender then only encodes the tensors, under the codec the link meter
        picks now, and MACs them). Greedy rounds only (a sampled round's q tensors are made with it)."""
        rnd = self.round
        assert rnd is not None and rnd.work.draft is not None
        basis, fields, q_tensors = self._header_fields()
        rows, codec = len(fields["input_ids"]) + len(fields["draft_ids"]), self.rt.link.codec()
        dtype, hidden_codec = DTYPE_NAMES[self.rt.shard.dtype], self.rt.link.hidden_codec()  # maybe 8-bit (lossy)
        hidden = TensorMeta(dtype=dtype, shape=[rows, self.hidden_size], codec=hidden_codec)
        metas = {"hidden": hidden, **{name: tensor_meta(t, codec) for name, t in q_tensors.items()}}
        rnd.header = (basis, *round_header(fields, metas, self.key))

    def outbound(self) -> Outbound:
        """The computed round as it goes to a sender thread: the header made ahead where it still holds (made for
        this batch), else the header's fields, and the tensors."""
        rnd = self.round
        assert rnd is not None and rnd.work.draft is not None and rnd.work.hidden is not None
        made = rnd.header
        if made is not None and made[0] == (rnd.work.tag, self.reply_to):
            rnd.out = Outbound(self.sid, self.stream, self.key, {"hidden": rnd.work.hidden}, made=(made[1], made[2]))
        else:
            _, header, q_tensors = self._header_fields()
            link = self.rt.link  # the hidden rows' codec: maybe 8-bit (lossy, relay.wire)
            tensors, codec, hidden = {"hidden": rnd.work.hidden, **q_tensors}, link.codec(), link.hidden_codec()
            rnd.out = Outbound(
                self.sid, self.stream, self.key, tensors, header=header, codec=codec, hidden_codec=hidden
            )
        return rnd.out

    def resend(self) -> Outbound:
        """BUSY, its wait over: the same round again, sealed anew."""
        assert self.round is not None and self.round.out is not None
        self.round.out = self.round.out.again()
        return self.round.out

    def _header_fields(self) -> tuple[tuple, dict, dict[str, torch.Tensor]]:
        """The round's header fields and q tensors, and what a header made ahead holds for (its batch, a retried
        one drafting anew, and the reply stream it names)."""
        rnd = self.round
        assert rnd is not None and rnd.work.draft is not None
        draft, work = rnd.work.draft, rnd.work
        q_kind, q_tensors = self._q(draft)
        header = dict(
            session_id=self.sid,
            head=self.head,
            round_id=rnd.rid,
            start_pos=rnd.start,
            input_ids=list(work.pending),
            draft_ids=list(draft.tokens),
            sampling=self.req.sampling,
            eos_token_ids=self.rt.eos_token_ids,
            max_new=rnd.remaining,
            q_kind=q_kind,
            replay=self.replay_next and not rnd.more,  # a replay in parts: its last part
            prefill_more=rnd.more,
            seed_round=self.resumed + self.rounds if self.parts else None,  # the round id, where no parts came
            reply_to=self.reply_to,
            layer=self.rt.shard.layer_range[1],
            route=self.hops[1:],
        )
        return (work.tag, self.reply_to), header, q_tensors

    def sent(self) -> None:
        """The round went out: IN_FLIGHT, its verdict due within the reply timeout."""
        assert self.round is not None
        self.round.sent_at, self.round.sent_wall = time.perf_counter(), time.time()
        timeout = self.reply_timeout_s if self.reply_timeout_s is not None else self.settings.relay.reply_timeout_s
        self.phase, self.due = Phase.IN_FLIGHT, time.monotonic() + timeout

    def take(self, entry_id: bytes, fields: dict) -> dict | None:
        """One entry of its reply stream, for the round in flight: stale (dropped), refused (its dead-letter record
        returned, for the loop to send), a full tail's "busy" (BUSY: the same round again after a wait), a replay
        (READY), or the round committed (READY, or `finish` set: the loop ends it). Raises what fails the
        generation."""
        rnd = self.round
        assert rnd is not None and rnd.work.draft is not None
        out = rnd.out
        mac = out.mac.result() if out is not None and out.mac.done() and not out.mac.exception() else ""
        drafts = rnd.work.draft.tokens
        want = Expected(self.key, self.sid, rnd.rid, mac, drafts, rnd.remaining, self.vocab_size, bool(rnd.more))
        msg = check_reply(fields, want, self.settings.relay)
        if msg is None:
            log.debug("session %s: dropping a stale reply", self.sid)
            return None
        if isinstance(msg, Refused):
            return self._refuse(entry_id, fields, msg)
        if isinstance(msg, ErrorReply):
            if msg.busy and not self.pinned:  # only a new session's round: no cache
                rnd.busy += 1
                self.phase, self.due = Phase.BUSY, time.monotonic() + self._busy_wait_s()
                return None
            if msg.non_finite:  # the same inputs overflow again on any tail: no replay
                raise NonFiniteError(f"tail {msg.tail_id or '?'}: {msg.error}")
            if msg.retryable:  # the tail lost this session (restarted under the same name, say)
                self._replay(ReplyTimeout(f"tail {msg.tail_id or '?'} lost the session: {msg.error}"))
            else:
                self._replay(RemoteError(f"tail {msg.tail_id or '?'} failed round {rnd.rid}: {msg.error}"))
            return None
        wait_s = time.perf_counter() - rnd.sent_at
        if not rnd.busy:  # the link and the tail, without waits for a full tail
            self.rt.batcher.plan.note_wait(wait_s)
        self.t.head_batch_rounds += 0 if rnd.more else rnd.work.batch  # batch sizes: of the decoding rounds
        self._account(rnd.work.draft, msg, (rnd.work.draft_s, rnd.work.head_s, wait_s), rnd.work.k_free, rnd.more)
        self._pin(msg)
        if rnd.more:  # a part of a long prompt, cached on both sides: the next round carries what follows
            self.pending, self.parts = self.pending[len(rnd.work.pending) :], self.parts + 1
        else:
            self.replay_next, self.finish, self.rounds = False, self._commit(msg, rnd.start), self.rounds + 1
        self.round, self.phase, self.since = None, Phase.READY, time.monotonic()
        return None

    def timed_out(self) -> None:
        """No verdict within the reply timeout: replay (raises once the replays are used up)."""
        self._replay(ReplyTimeout(f"no reply on {self.reply_stream} within the reply timeout"))

    def _busy_wait_s(self) -> float:
        """How long to wait before sending the round again to a full tail (doubling, capped)."""
        assert self.round is not None
        return min(
            self.settings.relay.tail_busy_wait_s * 2 ** (self.round.busy - 1), self.settings.relay.tail_busy_max_s
        )

    def result(self) -> GenerationResult:
        assert self.finish is not None
        self.t.total_ms = (time.perf_counter() - self.started) * 1000
        n = len(self.generated)
        return GenerationResult(
            session_id=self.sid,
            text=self.rt.tokenizer.decode(self.generated, skip_special_tokens=True),
            token_ids=self.generated,
            finish_reason=self.finish,
            prompt_tokens=len(self.prompt),
            completion_tokens=n,
            rounds=self.rounds,
            drafted_tokens=self.drafted,
            accepted_tokens=self.accepted,
            mean_accepted=self.accepted / max(self.rounds, 1),
            tokens_per_round=n / max(self.rounds, 1),
            tokens_per_s=n / max(self.t.total_ms / 1000, 1e-9),
            timings=self.t,
            resumed_tokens=self.resumed,
            replays=self.replays,
        )

    def run(self) -> GenerationResult:
        """Run to the end on the runtime's loop for this connection (blocking the caller only)."""
        return self.rt.loop_for(self.r).submit(self).result()

    def _already_finished(self) -> FinishReason | None:
        """A checkpoint can end where the generation did (the head died before storing the result)."""
        if not self.generated:
            return None
        if self.generated[-1] in self.rt.eos_token_ids:
            return "eos"
        if self.stops.hit(self.committed):
            return "stop"
        return "length" if len(self.generated) >= self.req.max_new_tokens else None

    def _q(self, draft: Draft) -> tuple[str, dict[str, torch.Tensor]]:
        if not draft.tokens or self.req.sampling.greedy:
            return "none", {}
        if draft.point or draft.q is None:
            return "point", {}
        return encode_q(draft.q)

    def _replay(self, why: ReplyTimeout | RemoteError) -> None:
        """The tail holding this session is gone, cut off, lost the session, or answered with an error (a
        tail's own, MAC'd: a forged one never gets here): rebuild the session on any live tail by replaying
        every committed token from position 0 in the next round (READY). The generation fails (with the last
        reason) once it has used `resume_attempts` replays."""
        if self.replays >= self.settings.relay.resume_attempts:
            raise type(why)(f"{why} (after {self.replays} replays onto other tails)")
        self.replays += 1
        log.warning("session %s: %s; replaying %d tokens onto a live tail", self.sid, why, len(self.committed))
        if self.phase is not Phase.WAITING:  # seated: its cache holds positions to drop
            self.cache.crop(0)
        self.pending, self.replay_next = list(self.committed), bool(self.generated)  # prompt only: a new round 0
        self.hops = self.rt.routes.route(self.r, self.names)  # a live route's shared streams
        self.round, self.since = None, time.monotonic()
        self.phase = Phase.READY if self.phase is not Phase.WAITING else Phase.WAITING

    def _refuse(self, entry_id: bytes, fields: dict, why: Refused) -> dict | None:
        """A reply-stream entry refused: its dead-letter record (the first few of a generation; all are counted)."""
        record = refusal(self.reply_stream, entry_id, why.reason, self.sid, why.msg, fields)
        kept = self.refusals.refuse(record)
        if self.refusals.refused in (1, self.settings.relay.reply_dead_letters_max):
            log.warning("session %s: refused %d reply-stream entries (%s)", self.sid, self.refusals.refused, why.reason)
        return kept

    def _account(self, draft: Draft, v: Verdict, spans: tuple[float, ...], free: bool = False, part: int = 0) -> None:
        timings = {k: x for k, x in v.timings.items() if k != "batch"} if part else v.timings
        add_round(self.t, timings, spans, self.round.sent_wall if self.round else 0.0, v.hop_ms)
        self.drafted += len(draft.tokens)
        self.accepted += v.accepted
        if self.req.draft.adaptive and draft.tokens:
            draft_s, head_s, wait_s = spans
            timed = self.req.sampling.greedy  # greedy output does not depend on K; seeded sampling does
            # free: graphs, where a shorter draft would cost the same and commit fewer tokens
            wire_ms = self.rt.link.draft_cost_ms() if timed else 0.0  # a draft row's cost on the head's link
            self.length.update(
                len(draft.tokens), v.accepted, draft_s * 1000, (head_s + wait_s) * 1000, timed, free, wire_ms
            )

    def _pin(self, v: Verdict) -> None:
        """A session's rounds after its first go to the workers that hold it: the stages its verdict names (its
        route's, in order) and the tail."""
        if not self.pinned:
            stages = self.hops[:-1]
            if len(v.hops) == len(stages):
                stages = [f"{hop}@{sid}" for hop, sid in zip(stages, v.hops, strict=True)]
            self.hops = [*stages, f"tail@{v.tail_id}"]

    def _commit(self, v: Verdict, start: int) -> FinishReason | None:
        finish = v.finish_reason
        self.tail_closed = finish is not None
        new: list[int] = []
        for tok in v.tokens:
            new.append(tok)
            self.committed.append(tok)
            if self.stops.hit(self.committed):
                finish = "stop"
                break
        self.generated += new
        if finish is None:
            assert v.next_token is not None  # verdict_problem checked it
            self.cache.crop(start + len(self.pending) + v.accepted)
            self.pending = [v.next_token]
        if self.on_tokens is not None and new:
            self.on_tokens(new, self.generated)
        return finish

    def release(self) -> None:
        """DONE: its slots freed, if it held any (no Redis)."""
        seated, self.phase = self.phase not in (Phase.WAITING, Phase.DONE), Phase.DONE
        if seated:
            self.rt.engine.release(self.cache)
            if self.drafter is not None:
                self.drafter.close()

    def goodbye(self) -> list[tuple[str, dict[bytes, bytes]]]:
        """For the loop's sender: the packets telling its workers to drop the session: every middle stage (none hears
        a verdict), and the tail unless a final verdict ended it there."""
        bye = encode_message(ClosePacket(session_id=self.sid), self.key)
        hops = self.hops if not self.tail_closed else self.hops[:-1]
        return [(self.names.hop_stream(hop), bye) for hop in hops]
