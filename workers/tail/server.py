"""The tail worker: upper shard + final norm + LM head, verification, one KV cache per session.

Run it with `shardflow tail --target MODEL --layers A:B --redis-url URL`. It reads new sessions from
the shared request stream (one consumer group for all tail replicas) and later rounds from its own
stream, verifies each round's drafts, rolls its cache back to the committed prefix, and replies on the
reply stream of the session's head (the one its rounds name). Every round is checked against its session's key
(its MAC, schemas/packets.py) before anything touches a cache: a forged one is dead-lettered, never answered, and
changes nothing. A bad packet of the session's own head gets a logged error and a (MAC'd) error reply; the worker
keeps serving everyone else. Sessions of heads that died, restarted or never announced themselves are freed
(workers/tail/liveness.py). Rounds whose hidden rows came 8-bit (a head's `relay.wire` fp8 / int8: lossy) are decoded
to the header's dtype like any others, or, under `relay.accept_lossy_wire` false, answered with an error.
"""

from __future__ import annotations

import logging
import threading
import time

import redis
import torch

from relay_broker.budgets import DeadLetterCap
from relay_broker.retry import ride_out
from relay_broker.streams import Entry, GroupReader, Reply, merge_replies
from schemas.codec import is_lossy
from schemas.errors import (
    NonFiniteError,
    PacketError,
    SessionError,
    TailBusy,
    TransportError,
)
from schemas.keys import Keys
from schemas.macs import mac_hex
from schemas.packets import (
    MAC,
    PROTOCOL_VERSION,
    ClosePacket,
    ErrorReply,
    RoundPacket,
    Verdict,
    encode_message,
    round_tensors,
)
from schemas.peek import peek_reply_to, peek_session, peek_version
from schemas.settings import Settings
from workers.engine.isolate import run_isolated
from workers.engine.numerics import non_finite_error
from workers.engine.per_layer import id_limit
from workers.engine.runner import Engine
from workers.engine.shard import Shard
from workers.engine.sizing import linger_s
from workers.phases import PhaseClock
from workers.speculative.stopping import cut_at_stops
from workers.speculative.verify import Outcome
from workers.tail.auth import Authenticator
from workers.tail.liveness import HeadWatch, keep_alive, session_for
from workers.tail.prefetch import Prefetch
from workers.tail.rounds import (
    BatchClock,
    DeadLetter,
    HostToDevice,
    Prepared,
    entries_age_ms,
    expand_groups,
    forward_inputs,
    log_bad,
    plan_rounds,
    reason_of,
    rewind,
    round_ids,
)
from workers.tail.sessions import TAIL_ID, SessionStore, TailSession, default_tail_id
from workers.tail.writer import Writer

log = logging.getLogger("shardflow.tail")


class TailWorker:
    """Serves rounds for many sessions from Redis streams until stopped."""

    def __init__(
        self,
        shard: Shard,
        r: redis.Redis,
        *,
        names: Keys | None = None,
        tail_id: str | None = None,
        engine: Engine | None = None,
        settings: Settings | None = None,
    ) -> None:
        """`settings` (default: Settings()): sessions kept (max_sessions, session_ttl_s), the largest packet,
        stream caps and expiries; `engine` runs the shard (default: from the shard's device and settings)."""
        if (shard.lm_head is not None) != self.last:
            raise ValueError(f"a {self.role} shard {'needs' if self.last else 'has no'} the final norm and LM head")
        self.settings = cfg = settings or Settings()
        self.shard, self.r, self.max_packet_bytes = shard, r, cfg.relay.max_packet_bytes
        self.id_limit = id_limit(shard.config)  # the vocabulary (and Gemma 4's per-layer table: its ids index it)
        self.hidden_size: int = shard.config.hidden_size  # read once: a config's attributes are slow (per round)
        self.engine = engine or Engine(shard, settings=cfg, label="tail")
        self.names = names or Keys()
        self.tail_id = tail_id or default_tail_id()
        if not TAIL_ID.fullmatch(self.tail_id):
            raise ValueError(f"tail name {self.tail_id!r}: use 1-64 letters, digits, '.', '_' or '-'")
        if cfg.relay.max_sessions < self.engine.slots:  # a batch's sessions must never evict one another
            raise ValueError(
                f"max_sessions ({cfg.relay.max_sessions}) must be at least the batch slots ({self.engine.slots})"
            )
        self.sessions = SessionStore(cfg.relay.max_sessions, cfg.relay.session_ttl_s, release=self.engine.release)
        self.heads = HeadWatch(r, self.names, cfg)
        wait_s = linger_s(shard, cfg)
        self.linger_ms = max(1, round(wait_s * 1000)) if wait_s > 0 else 0  # a Redis BLOCK time: whole ms
        t = self.engine.step_tokens  # a padded round, logits of every row or of the last (no drafts)
        if captured := self.engine.capture([(t, t, 0), (t, 1, 0)]):
            log.info("tail captured %d CUDA graphs", captured)
        self.stop_event = threading.Event()
        self._dead: list[DeadLetter] = []
        self.dead_cap = DeadLetterCap(cfg.relay.dead_letter_rate, cfg.relay.dead_letter_burst)
        self._last_keepalive = 0.0
        self.clock = PhaseClock("tail loop", log)  # where the loop's time goes, logged every 10 s
        self.upload = HostToDevice(shard.device)
        self.auth = Authenticator(self.sessions, cfg.relay)
        self._queue_ms = 0.0  # how long the entries of the batch being handled waited in Redis (mean)
        self._taken_at_ms = self._prepare_ms = 0.0  # when they were read (wall clock), their decoding and checks
        group, shared, own = self.lanes()
        self.reader = GroupReader(  # new sessions a dead worker read but never answered are claimed after a while
            r,
            group,
            self.tail_id,
            [shared, own],
            claim_streams=[shared],
            dead_stream=self.names.dead_letters,
            settings=cfg,
        )
        self.writer = Writer(self.reader, cfg, self.clock, self.stop_event.is_set)
        self._prefetch: Prefetch | None = None  # the reads' thread, started by `serve`

    role = "tail"
    last = True  # runs the LM head and verifies (a middle stage passes its hidden states on: workers/stage/)

    def lanes(self) -> tuple[str, str, str]:
        """(consumer group, shared stream of new sessions, this worker's own stream of pinned ones)."""
        return self.names.tail_group, self.names.shared_requests, self.names.tail_requests(self.tail_id)

    def serve(self) -> None:
        """Handle packets until `stop_event` is set."""
        log.info("%s %s serving layers %s on %s", self.role, self.tail_id, self.shard.layer_range, self.lanes()[1])
        self._prefetch = Prefetch(self._read, self.reader.reset, self.stop_event, self.settings, self.tail_id)
        while not self.stop_event.is_set():
            try:  # Redis gone, restarted, full, read-only, ...: ride it out (relay_broker.retry)
                ride_out(
                    self._serve_once,
                    errors=(TransportError, redis.RedisError),
                    stop=self.stop_event.is_set,
                    on_retry=self._lost_redis,
                    sleep=self.stop_event.wait,
                    settings=self.settings,
                )
            except (TransportError, redis.RedisError):
                break  # stopped while Redis was away
            self.sessions.expire()
            self.heads.sweep(self.sessions)
            self._keepalive()
        self.writer.close()  # the last batches' replies and acks written before the worker goes

    def _lost_redis(self, e: BaseException, wait_s: float) -> None:
        log.warning("tail %s: %s; retrying in %.1fs", self.tail_id, e, wait_s)

    def _read(self) -> list[Entry]:
        """A batch's entries (on the reads' thread: workers/tail/prefetch.py): up to the slots, gathered."""
        n = self.engine.slots
        return self.reader.gather(self.reader.read(count=n), slots=n, open_sessions=len(self.sessions),
                                  linger_ms=self.linger_ms)  # fmt: skip

    def _keepalive(self) -> None:
        """Now and then (tail_keepalive_s): this tail's stream kept, dead tails' idle consumers dropped."""
        now = time.monotonic()
        if now - self._last_keepalive >= self.settings.relay.tail_keepalive_s:
            self._last_keepalive = now
            keep_alive(self.r, self.names, self.tail_id, self.settings)

    def _serve_once(self) -> None:
        clock = self.clock
        clock.maybe_log()
        assert self._prefetch is not None
        with clock("wait"):  # for the reads' thread: blocked at Redis, or nothing came
            entries = self._prefetch.take(self.settings.redis.block_ms / 1000)
        self._queue_ms, self._taken_at_ms = entries_age_ms(entries), time.time() * 1000  # since Redis had them
        if entries:
            try:
                self._serve_batch(entries)
            finally:  # computed (or failed), and let go: the reads may go on past a large batch
                entries = []
                self._prefetch.finished()

    def _serve_batch(self, entries: list[Entry]) -> None:
        """A batch's rounds unpacked, checked, computed, and their replies and acks handed to the writer."""
        clock = self.clock
        with clock("unpack"):
            flat, bad = expand_groups(entries, self.max_packet_bytes, self.auth.shares)  # a group: its rounds
        done: list = [(stream, entry_id, None) for stream, entry_id, _ in bad]
        cap = self.dead_cap  # at most relay.dead_letter_rate a second per source stream; the rest are counted
        dead = [letter.record(stream, entry_id, self.tail_id) for stream, entry_id, letter in bad if cap.allow(stream)]
        for at in range(0, len(flat), self.engine.slots):  # a batch's sessions never outnumber the slots
            chunk = flat[at : at + self.engine.slots]
            replies = self.handle_many([fields for _, _, fields in chunk])
            done += [(stream, entry_id, reply) for (stream, entry_id, _), reply in zip(chunk, replies, strict=True)]
            where = {id(fields): (stream, entry_id) for stream, entry_id, fields in chunk}
            for letter in self.take_dead_letters():
                if cap.allow(where[id(letter.fields)][0]):
                    dead.append(letter.record(*where[id(letter.fields)], self.tail_id))
        written, dropped = cap.take_counts()
        clock.count("dead letters", written)
        clock.count("dead letters dropped", dropped)
        # replies (those for one head's stream packed into one entry), acks and dead letters: one round trip, on the
        # writer's thread while this loop reads and computes the next batch (workers/tail/writer.py)
        self.writer.put(self.pack(done), dead)

    def pack(self, done: list) -> list:
        """The acks with their replies as they go out (one head's replies in one entry: `merge_replies`)."""
        return merge_replies(done)

    def take_dead_letters(self) -> list[DeadLetter]:
        """Packets refused since the last call (each with its reason), for the dead-letter stream."""
        dead, self._dead = self._dead, []
        return dead

    def handle(self, fields: dict) -> Reply | None:
        """Process one stream entry; return the reply to send, if any."""
        return self.handle_many([fields])[0]

    def handle_many(self, entries: list[dict]) -> list[Reply | None]:
        """Process stream entries read together; rounds of different sessions run as one batched forward.
        Never raises for a bad packet: it is logged and answered with an error when it names a session."""
        t0 = time.perf_counter()
        out: list[Reply | None] = [None] * len(entries)
        batch: list[tuple[int, Prepared]] = []
        later: list[int] = []  # an authentic packet of a session already in this batch waits for the batch
        joined: set[str] = set()  # sessions with a round in the batch (a forged packet naming one joins nothing)
        for i, checked in enumerate(self.auth.check(entries)):
            fields = entries[i]
            if isinstance(checked, Exception):
                sid, rid = peek_session(fields)
                out[i] = self._refuse(sid, rid, checked, fields)
                continue
            msg, key, oversized = checked
            if msg.session_id in joined:
                later.append(i)
                continue
            try:
                if oversized is not None:  # its own head's: it hears why
                    raise oversized
                prep = self._prepare(msg, key, fields)
            except Exception as e:
                out[i] = self._fail_with(msg.session_id, getattr(msg, "round_id", None), e, fields, key)
                continue
            if isinstance(prep, Prepared):
                batch.append((i, prep))
                joined.add(msg.session_id)
            else:
                out[i] = prep
        self._prepare_ms = (time.perf_counter() - t0) * 1000
        self.clock.add("prepare", self._prepare_ms / 1000)
        for (i, _), reply in zip(batch, self._rounds([p for _, p in batch]), strict=True):
            out[i] = reply
        for i in later:
            out[i] = self.handle(entries[i])
        return out

    def _refuse(self, sid: str | None, rid: int | None, e: Exception, fields: dict) -> Reply | None:
        """Dead-letter a packet that did not authenticate, with the reason; touch no session. Two are answered,
        unsigned (there is no key to sign with): a round for a session this tail does not hold, echoing the
        round's MAC, so its head replays the session onto a live tail at once; and a packet of another
        protocol version, so a head of another release logs why (a head of this one refuses the reply)."""
        log_bad(sid, rid, e)
        self._dead.append(DeadLetter(fields, reason_of(e), sid, rid))
        if sid is None:
            return None
        mac = mac_hex(fields)
        if isinstance(e, SessionError) and rid is not None and len(mac) == 64:
            msg = ErrorReply(session_id=sid, round_id=rid, error=str(e), tail_id=self.tail_id, retryable=True, echo=mac)
        elif isinstance(e, PacketError) and (v := peek_version(fields)) != PROTOCOL_VERSION and isinstance(v, int):
            msg = ErrorReply(session_id=sid, round_id=rid, error=str(e), tail_id=self.tail_id)
        else:
            return None
        return self._reply_for(fields, encode_message(msg))

    def _fail_with(self, sid: str, rid: int | None, e: Exception, fields: dict, key: bytes | None) -> Reply | None:
        """Dead-letter an authentic packet that failed with its reason, drop its session (its cache may be
        half-updated) and answer it with a MAC'd error; a session this tail lost gets a retryable one (the
        head replays)."""
        reason = reason_of(e)
        log_bad(sid, rid, e)
        self._dead.append(DeadLetter(fields, reason, sid, rid))
        self.sessions.drop(sid)
        if key is None:
            return None
        msg = ErrorReply(
            session_id=sid,
            round_id=rid,
            error=reason,
            tail_id=self.tail_id,
            retryable=isinstance(e, SessionError),
            non_finite=isinstance(e, NonFiniteError),
        )
        return self._reply_for(fields, encode_message(msg, key))

    def _reply_for(self, packet: dict, fields: dict) -> Reply | None:
        """An error reply to a packet that did not validate: on the reply stream its header names, if it names one."""
        to = peek_reply_to(packet)
        return Reply(self.names.reply(to), fields) if to is not None else None

    def _reply(self, p: RoundPacket, fields: dict) -> Reply:
        """A round's reply, on its head's reply stream."""
        return Reply(self.names.reply(p.reply_to), fields)

    def _session_for(self, p: RoundPacket, key: bytes, mac: bytes) -> TailSession | None:
        return session_for(p, key, self.sessions, self.heads, self.engine, self.tail_id, mac)

    def _prepare(self, msg: RoundPacket | ClosePacket, key: bytes | None, fields: dict) -> Prepared | Reply | None:
        """Check one authentic entry: a round to run, or the reply to send at once (None: nothing)."""
        if isinstance(msg, ClosePacket) or key is None:
            self.sessions.drop(msg.session_id)
            return None
        if max(msg.input_ids + msg.draft_ids) >= self.id_limit:  # the vocabulary's, or Gemma 4's per-layer table's
            raise PacketError(f"token ids must be below the vocabulary size {self.id_limit}")
        if msg.layer is not None and msg.layer != self.shard.layer_range[0]:
            raise PacketError(f"hidden rows for layer {msg.layer}; this {self.role} runs {self.shard.layer_range}")
        if bool(msg.route) == self.last:
            raise PacketError(f"a route of {len(msg.route)} more hops at a {self.role}")
        if not self.settings.relay.accept_lossy_wire and is_lossy(codec := msg.tensors["hidden"].codec):
            raise PacketError(f"this tail refuses 8-bit hidden rows ({codec}: relay.accept_lossy_wire is false)")
        try:
            sess = self._session_for(msg, key, fields.get(MAC, b""))
        except TailBusy as e:  # the head waits and sends the round again: nothing to dead-letter
            busy = ErrorReply(
                session_id=msg.session_id, round_id=msg.round_id, error=str(e), tail_id=self.tail_id, busy=True
            )
            return self._reply(msg, encode_message(busy, key))
        if sess is None:  # duplicate or late: answer again with the verdict already sent, if it was the last one
            dup = self.sessions.get(msg.session_id)
            last = dup.last_reply if dup is not None and dup.last_round == msg.round_id else None
            held = dup.last_round if dup is not None else None
            why = f"duplicate or late round (session at round {held})"
            if dup is None and (final := self.sessions.served(msg.session_id)) is not None:
                last, why = final, "an opening round of a session already served here (its final verdict again)"
            self._dead.append(DeadLetter(fields, why, *peek_session(fields)))
            return self._reply(msg, last) if last is not None else None
        # on the host; the hidden rows uncopied (views of the entry's bytes): a batch's rows go in one copy (upload)
        tensors = round_tensors(msg, fields, caps=self.settings.relay, views=frozenset({"hidden"}))
        hidden = tensors["hidden"]
        width = self.hidden_size
        if not hidden.is_floating_point() or hidden.ndim != 2 or hidden.shape[1] != width:
            raise PacketError(f"hidden states must be float [n, {width}], got {hidden.dtype} {list(hidden.shape)}")
        if hidden.shape[0] != len(msg.input_ids) + len(msg.draft_ids):
            raise PacketError(f"{hidden.shape[0]} hidden rows for {len(msg.input_ids) + len(msg.draft_ids)} tokens")
        end = msg.start_pos + hidden.shape[0] + msg.prefill_more  # a part: where its whole prompt ends
        if self.engine.static and end > self.engine.max_len:
            raise PacketError(f"round ends at position {end}, beyond this tail's cache of {self.engine.max_len}")
        return Prepared(msg, sess, key, hidden.to(self.shard.dtype), tensors, fields)

    @torch.inference_mode()
    def _rounds(self, batch: list[Prepared]) -> list[Reply | None]:
        """One batched forward over every prepared round, then each round's verification; a forward that
        fails is retried round by round (`run_isolated`), so only the round that fails alone gets an error."""
        return run_isolated(batch, self._rounds_together, rewind, self._fail_prepared) if batch else []

    def _fail_prepared(self, p: Prepared, e: Exception) -> Reply | None:
        return self._fail_with(p.packet.session_id, p.packet.round_id, e, p.fields, p.key)

    def _rounds_together(self, batch: list[Prepared]) -> list[Reply | None]:
        clock = BatchClock(self.shard.device)
        warp_rows = self.settings.engine.verify_warp_rows
        plan = plan_rounds(batch, self.shard.device, warp_rows)  # its ids copy during the forward
        ids = round_ids(batch, self.shard.device) if self.shard.needs_ids else None  # Gemma 4's per-layer inputs
        logits = clock.forward_done(self.engine.forward_many(*forward_inputs(batch, self.upload), ids=ids))
        judged = plan.run(logits, lambda: non_finite_error("logits", self.shard.layer_range, self.shard.dtype))
        timings = dict(zip(("tail_forward_ms", "verify_ms"), clock.split(), strict=True)) | {"batch": len(batch)}
        timings |= {"queue_ms": self._queue_ms, "taken_at_ms": self._taken_at_ms, "prepare_ms": self._prepare_ms}
        timings["replied_at_ms"] = time.time() * 1000  # its verdicts go out with the next round trip
        self.clock.add("forward+verify", (timings["tail_forward_ms"] + timings["verify_ms"]) / 1000)
        out: list[Reply | None] = []
        for p, got in zip(batch, judged, strict=True):  # the batch's one wait for the device is behind it
            try:
                out.append(self._verify(p, got, timings))
            except Exception as e:
                out.append(self._fail_prepared(p, e))
        return out

    def _verify(self, prep: Prepared, judged: Outcome, timings: dict[str, float]) -> Reply:
        """Commit a judged round, or raise its error: crop the cache to the committed prefix, build the verdict. A
        final verdict ends the session here: the tail drops it and remembers it served (its head, which reads the
        verdict at once, sends no close)."""
        if isinstance(judged, Exception):
            raise judged
        (accepted, nxt), p, sess = judged, prep.packet, prep.sess
        tokens, finish = cut_at_stops(p.draft_ids[:accepted] + [nxt], p.eos_token_ids, p.max_new)
        if p.prefill_more:  # a part of a long prompt (no drafts): its rows stay cached, nothing is committed
            tokens, finish = [], None
        sess.cache.crop(p.start_pos + len(p.input_ids) + accepted)
        verdict = Verdict(
            session_id=p.session_id,
            round_id=p.round_id,
            accepted=accepted,
            tokens=tokens,
            next_token=nxt if len(tokens) == accepted + 1 else None,
            finish_reason=finish,
            tail_id=self.tail_id,
            hops=p.hops,
            hop_ms=p.hop_ms,
            timings=timings,
        )
        sess.last_round, sess.last_reply = p.round_id, encode_message(verdict, prep.key)
        sess.last_mac = prep.fields.get(MAC, b"")
        if finish is None:
            return self._reply(p, sess.last_reply)
        self.sessions.finish(p.session_id, sess.last_reply)
        return self._reply(p, sess.last_reply)
