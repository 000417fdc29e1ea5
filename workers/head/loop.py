"""The head's step loop: one thread owns every generation in flight on one Redis connection.

Each step it
1. admits the generations submitted since the last one once a cache slot of their length is free (their first round
   carries the prompt, so prompts run batched with the other rounds of their group);
2. hands each generation the replies that came for it (commits verdicts, streaming text and progress through its
   callback; waits after a full tail's "busy"; replays after a tail's error or silence), and retires finished ones;
3. computes one group of the ready generations: drafts for all at once and the lower shard once over all
   (`Batcher.compute`, workers/head/batching.py; meanwhile it takes the replies for generations outside the group),
   and queues the group to a sender thread, which seals each round and publishes the group (schemas/groups.py).

The loop never waits on Redis: sender threads publish what it queues, receivers read the head's own reply stream
(workers/head/relay_io.py). With nothing to compute it sleeps until a reply, a submission or the next deadline.
Groups are about live / G generations (workers/head/groups.py, from measured stage and link times); a CPU head lingers
briefly for a group's worth of ready ones (`Batcher.linger_s`). No thread per generation: callers submit a
`RoundLoop` and get a Future; once submitted, a generation's state changes on this thread only.
"""

from __future__ import annotations

import enum
import logging
import math
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import redis
from rq.timeouts import JobTimeoutException

from relay_broker.budgets import DeadLetterCap
from schemas.requests import GenerationResult
from workers.head.beacon import reply_group
from workers.head.core import Runtime
from workers.head.relay_io import Outgoing, Receiver, Reply, Sender
from workers.head.rounds import Outcome, RoundLoop
from workers.head.sealing import outbound, packets, sealed
from workers.head.seating import seat, withdraw
from workers.phases import PhaseClock

log = logging.getLogger("shardflow.head")
MAX_HELD = 64  # reply-stream entries kept for a generation between its rounds (a flood beyond is dropped unread)


class State(enum.Enum):
    READY = "ready"  # its next round is to be computed
    SENT = "sent"  # its round is on the wire: waiting for the verdict until `due`
    BUSY = "busy"  # a full tail refused its new session: sent again at `due`


@dataclass(eq=False)
class Slot:
    """One generation in the loop."""

    gen: RoundLoop
    future: Future
    deadline: float | None  # the job's timeout (monotonic), if any
    state: State = State.READY
    due: float = 0.0
    since: float = field(default_factory=time.monotonic)  # when it became ready
    replies: list[tuple[bytes, dict]] = field(default_factory=list)  # (entry id, fields) not yet taken


class HeadLoop:
    """Steps every generation submitted to it, on a thread of its own (see the module docstring)."""

    def __init__(self, runtime: Runtime, r: redis.Redis) -> None:
        self.rt, self.r, self.settings = runtime, r, runtime.settings
        self.slots: dict[str, Slot] = {}  # by session id
        self._inbox: list[Slot] = []
        self._waiting: list[Slot] = []  # submitted, waiting for a free slot of their length (`_admit`)
        self._seat_now = False  # a generation ended while others wait: the next step seats them
        self._cancels: list[tuple[Future, BaseException]] = []  # asked to end before they were seated (`cancel`)
        self._replies: list[Reply] = []
        self._failed: list[tuple[list[Slot], BaseException]] = []
        self._cv = threading.Condition()
        self.steps = 0
        self._idle_s = 0.0  # of the group being computed: the time `_meanwhile` took
        self._group: list[Slot] = []  # the group being computed (its headers are made while its forward runs)
        self._held: list[tuple[list[Slot], BaseException]] = []  # its failed sends, taken once it is computed
        self.clock = PhaseClock("head loop", log)  # where the loop's time goes, logged every 10 s
        self.seal_clock = PhaseClock("head senders", log)  # sealing a group's rounds, on the sender threads
        self.relay_clock = PhaseClock("head relay", log)  # a reply's wait from its reader to the loop ("lag")
        self._replies_at: float | None = None  # when the oldest reply not yet taken came from its reader
        self.sender = Sender(r, self.settings, self.seal_clock)
        relay = self.settings.relay
        self.dead_cap = DeadLetterCap(relay.dead_letter_rate, relay.dead_letter_burst)  # counted in relay_clock's lines
        self._epochs = 0  # the beacons' reply-stream moves the generations in flight have followed
        group = reply_group(runtime.beacons.ref)
        self.receiver = Receiver(r, self.settings, self._deliver, self.sender, group=group, dead_cap=self.dead_cap)
        threading.Thread(target=self._run, daemon=True, name="head-loop").start()

    def submit(self, gen: RoundLoop, timeout_s: float | None = None) -> Future[GenerationResult]:
        """Run `gen` to its end; the Future holds its result or what failed it (a timeout: JobTimeoutException)."""
        future: Future[GenerationResult] = Future()
        deadline = time.monotonic() + timeout_s if timeout_s is not None and timeout_s > 0 else None
        with self._cv:
            self._inbox.append(Slot(gen, future, deadline))
            self._cv.notify()
        return future

    def cancel(self, future: Future, why: BaseException) -> None:
        """End `future`'s generation with `why` if it still waits for a slot (seated: at its next progress flush)."""
        with self._cv:
            self._cancels.append((future, why))
            self._cv.notify()

    def slot_freed(self) -> None:  # a loop of this head gave cache slots back: generations waiting here try again
        with self._cv:
            self._seat_now = True
            self._cv.notify()

    def _deliver(self, replies: list[Reply]) -> None:
        with self._cv:
            if not self._replies:
                self._replies_at = time.perf_counter()
            self._replies += replies
            self._cv.notify()

    def _lag(self, replies: list[Reply]) -> None:
        """Under the lock, replies just taken: how long the oldest waited for the loop since its reader had it."""
        if replies and self._replies_at is not None:
            self.relay_clock.add("lag", time.perf_counter() - self._replies_at)

    # --- the loop -------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                self._step()
            except BaseException as e:  # a bug: every generation fails with it, the loop goes on
                log.exception("head loop: a step failed; failing the %d generations in flight", len(self.slots))
                for slot in list(self.slots.values()):
                    self._fail(slot, e)

    def _step(self) -> None:
        clock = self.clock
        with clock("wait"):
            new, replies, failed = self._wait()
        if self.rt.beacons.epochs != self._epochs:
            self._follow_reply_streams()
        with clock("admit"):
            self._admit(new)
            for slots, e in failed:
                for slot in slots:
                    self._fail(slot, e)
        with clock("replies"):
            self._route(replies)
        now = time.monotonic()
        self._expire(now)
        # rounds a full tail refused, whose wait is over: the same packets again
        self._send([s for s in self.slots.values() if s.state is State.BUSY and s.due <= now and s.gen.round])
        ready = [s for s in self.slots.values() if s.state is State.READY]
        size = math.ceil(max(len(self.slots), 1) / self.rt.batcher.plan.groups(len(self.slots)))
        if ready and self._linger_s(ready, size, now) <= 0:
            self._compute(ready[:size])
        self.steps += 1
        clock.maybe_log()
        self.seal_clock.maybe_log()
        written, dropped = self.dead_cap.take_counts()
        self.relay_clock.count("dead letters", written)
        self.relay_clock.count("dead letters dropped", dropped)
        self.relay_clock.maybe_log()

    def _follow_reply_streams(self) -> None:
        """A beacon moved to a fresh reply stream (workers/head/beacon.py): every generation in flight reads it now,
        and its next round names it."""
        self._epochs = self.rt.beacons.epochs
        for slot in self.slots.values():
            gen = slot.gen
            reply_to = self.rt.beacons.reply_to(gen.names)
            if reply_to != gen.reply_to:
                self.receiver.unwatch(gen.refusals.stream)
                gen.reply_to, gen.refusals.stream = reply_to, gen.names.reply(reply_to)
                self.receiver.watch(gen.refusals.stream, gen.names.dead_letters)

    def _wait(self) -> tuple[list[Slot], list[Reply], list]:
        """What the I/O threads and callers brought; sleeps while there is nothing to do."""
        with self._cv:
            while not (self._inbox or self._replies or self._failed or self._seat_now or self._cancels):
                wait = self._sleep_s()
                if wait is not None and wait <= 0:
                    break
                self._cv.wait(wait)
            new, self._inbox = self._inbox, []
            replies, self._replies = self._replies, []
            self._lag(replies)
            failed, self._failed = self._failed, []
            (self._waiting, new), self._cancels = withdraw((self._waiting, new), self._cancels), []
        return new, replies, failed

    def _sleep_s(self) -> float | None:
        """How long the loop may sleep: 0 with rounds ready to compute (past any linger), else until the next
        deadline (None: until something comes)."""
        now = time.monotonic()
        ready = [s for s in self.slots.values() if s.state is State.READY]
        if ready:
            size = math.ceil(len(self.slots) / self.rt.batcher.plan.groups(len(self.slots)))
            return self._linger_s(ready, size, now)
        slots = [*self.slots.values(), *self._waiting]  # a waiting generation's timeout wakes the loop too
        dues = [s.due for s in self.slots.values()] + [s.deadline for s in slots if s.deadline]
        return max(min(dues) - now, 0.0) if dues else None  # 0: a deadline has come (a resend, a timeout)

    def _admit(self, new: list[Slot]) -> None:
        """Begin the generations that have a cache slot of their length (workers/head/seating.py); others wait."""
        seated, self._waiting = seat(self._waiting, new, time.monotonic(), self._seat_now)
        self._seat_now = False
        for slot in seated:
            gen = slot.gen
            gen.reply_to = self.rt.beacons.reply_to(gen.names)  # its beacon was ensured when it was made
            gen.refusals.stream = gen.names.reply(gen.reply_to)  # where its dead letters say the reply was
            self.receiver.watch(gen.refusals.stream, gen.names.dead_letters)
            try:
                if gen.begin() is not None:  # a checkpoint that already ends the generation
                    self._done(slot, add=False)
                    continue
            except BaseException as e:
                self._fail(slot, e, add=False)
                continue
            self.slots[gen.sid] = slot

    def _linger_s(self, ready: list[Slot], size: int, now: float) -> float:
        """How much longer a CPU head waits for a group's worth of ready generations (0: compute now)."""
        linger = self.rt.batcher.linger_s
        if linger <= 0 or len(ready) >= size or not any(s.state is State.SENT for s in self.slots.values()):
            return 0.0
        bound = min(max(4 * linger, self.rt.batcher.plan.wait or 0.0), 50 * linger)
        return max(bound - (now - min(s.since for s in ready)), 0.0)

    # --- compute and send -----------------------------------------------------------------------------
    def _compute(self, group: list[Slot]) -> None:
        with self.clock("work"):
            works = [s.gen.next_work() for s in group]
        self._idle_s, self._group = 0.0, group
        with self.rt.lock:
            t0 = time.perf_counter()
            poll = self._poll if self.settings.relay.head_wait_poll_ms > 0 else None
            self.rt.batcher.compute(works, idle=self._meanwhile, poll=poll)
            spent = time.perf_counter() - t0 - self._idle_s
            self.rt.batcher.plan.note_batch(len(works), spent)
            self.clock.add("compute", spent)
        with self._cv:  # the group's failed sends held while it computed: the next step takes them
            self._failed, self._held = self._held + self._failed, []
        ok: list[Slot] = []
        for slot, work in zip(group, works, strict=True):
            if work.error is not None:
                self._fail(slot, work.error)
            else:
                ok.append(slot)
        self._send(ok, build=True)

    def _meanwhile(self) -> None:
        """While the device runs a group's whole draft or its lower shard: the replies and failed sends that came
        since the step began, taken now rather than after the group (the group's own generations are READY:
        untouched), then the rounds' headers."""
        self._take_meanwhile(0.0)
        t0 = time.perf_counter()
        self._headers()
        dt = time.perf_counter() - t0
        self._idle_s += dt  # called again if the group is retried item by item
        self.clock.add("headers", dt)

    def _poll(self) -> None:
        """While the group waits for the device: a reply coming within `relay.head_wait_poll_ms` is taken now."""
        self._take_meanwhile(self.settings.relay.head_wait_poll_ms / 1000)

    def _take_meanwhile(self, wait_s: float) -> None:
        with self._cv:
            if wait_s > 0 and not (self._replies or self._failed):
                self._cv.wait(wait_s)
            replies, self._replies, failed, self._failed = self._replies, [], self._failed, []
            self._lag(replies)
            failed = self._after_group(failed)
        if replies or failed:
            t0 = time.perf_counter()
            for slot, e in ((slot, e) for slots, e in failed for slot in slots):
                self._fail(slot, e)
            self._route(replies)
            self._idle_s += (dt := time.perf_counter() - t0)
            self.clock.add("replies", dt)

    def _after_group(self, failed: list[tuple[list[Slot], BaseException]]) -> list[tuple[list[Slot], BaseException]]:
        """Failed sends to take while a group computes: its own generations' are held until it is done (failing one
        now would free caches its queued forward, or its retry alone, still writes)."""
        group = {id(s) for s in self._group}
        self._held += [(mine, e) for slots, e in failed if (mine := [s for s in slots if id(s) in group])]
        return [(rest, e) for slots, e in failed if (rest := [s for s in slots if id(s) not in group])]

    def _headers(self) -> None:
        """While the device computes the group's hidden states (its drafts known): each greedy round's header,
        made now rather than on the sender's thread after the forward (`RoundLoop.prepare`). One that cannot be
        made is made again, or fails, when the round is sealed."""
        for slot in self._group:
            rnd = slot.gen.round
            work = rnd.work if rnd is not None else None
            if work is None or work.draft is None or work.hidden is not None or not work.sampling.greedy:
                continue
            if rnd.header is not None and rnd.header[0][2] == work.tag:  # made for this batch already
                continue
            try:
                slot.gen.prepare()
            except Exception:
                log.debug("head: a round's header could not be made ahead; it is made when sealed", exc_info=True)

    def _send(self, slots: list[Slot], build: bool = False) -> None:
        """Put these rounds on the wire: sealed on a sender thread (`build`: just computed), or as before (resent)."""
        if not slots:
            return
        for slot in slots:
            slot.state, slot.due = State.SENT, slot.gen.sent()
            if slot.replies:  # entries that came while it was READY (none can answer this round yet)
                self._take(slot)
        slots = [s for s in slots if self.slots.get(s.gen.sid) is s]  # one of those may have failed it
        if not slots:
            return

        def failed(e: BaseException) -> None:
            with self._cv:
                self._failed.append((slots, e))
                self._cv.notify()

        if build:
            self.sender.put(Outgoing([], on_error=failed, build=lambda: self._seal(slots)))
        else:
            again = [outbound(s) for s in slots if s.gen.round]  # sealed anew, as when first sent
            self.sender.put(Outgoing([], on_error=failed, build=lambda: sealed(again, self.settings.relay)))

    def _seal(self, slots: list[Slot]) -> list[tuple[str, dict]]:
        """On a sender's thread: each round's sealed fields (one that cannot be sealed fails alone, on the loop), then
        the group entries. The loop touches none of these rounds until a reply or a timeout, after this send."""
        t0 = time.perf_counter()
        made = packets(slots)  # each round's fields: its tensors' bytes copied from pinned memory, nothing hashed
        bad: list[tuple[list[Slot], BaseException]] = [([s], got) for s, got in made if isinstance(got, Exception)]
        if bad:
            with self._cv:
                self._failed += bad
                self._cv.notify()
        group = sealed([got for _, got in made if not isinstance(got, Exception)], self.settings.relay)
        self.seal_clock.add("seal", time.perf_counter() - t0)
        return group

    # --- replies --------------------------------------------------------------------------------------
    def _route(self, replies: list[Reply]) -> None:
        touched: list[Slot] = []
        for sid, entry_id, fields in replies:
            slot = self.slots.get(sid) if sid is not None else None
            if slot is None:  # a session that ended (a late duplicate), or junk naming none: nothing to do
                log.debug("head: a reply for no session in flight (%s)", sid)
                continue
            slot.replies.append((entry_id, fields))
            touched.append(slot)
        for slot in dict.fromkeys(touched):
            self._take(slot)

    def _take(self, slot: Slot) -> None:
        while slot.replies and slot.state is not State.READY and slot.gen.sid in self.slots:
            entry_id, fields = slot.replies.pop(0)
            if slot.state is State.BUSY:
                continue  # the round it answered goes again: a later reply answers that
            slot.gen.refusals.entry_id = entry_id
            try:
                outcome = slot.gen.take(fields)
            except BaseException as e:
                self._fail(slot, e)
                return
            if outcome is Outcome.BUSY:
                slot.state, slot.due = State.BUSY, time.monotonic() + slot.gen.busy_wait_s()
            elif outcome is Outcome.FINISHED:
                self._done(slot)
            elif outcome is not Outcome.IGNORED:  # committed, or a replay: the next round is computed
                slot.state, slot.since = State.READY, time.monotonic()
        # what is left (READY) is checked against its next round once sent: stale dropped, forged dead-lettered
        del slot.replies[:-MAX_HELD]

    def _expire(self, now: float) -> None:
        for slot in list(self.slots.values()):
            if slot.deadline is not None and now > slot.deadline:
                self._fail(slot, JobTimeoutException("the job ran past its timeout"))
            elif slot.state is State.SENT and now > slot.due:
                try:
                    slot.gen.timed_out()
                except BaseException as e:
                    self._fail(slot, e)
                    continue
                slot.state, slot.since = State.READY, now

    # --- ends -----------------------------------------------------------------------------------------
    def _done(self, slot: Slot, add: bool = True) -> None:
        try:
            result = slot.gen.result()
        except BaseException as e:
            self._fail(slot, e, add)
            return
        self._retire(slot, add)
        slot.future.set_result(result)

    def _fail(self, slot: Slot, e: BaseException, add: bool = True) -> None:
        if add and self.slots.get(slot.gen.sid) is not slot:
            return  # retired already (a round that could not be sealed, then its group's send failed too)
        self._retire(slot, add)
        if not slot.future.done():
            slot.future.set_exception(e)

    def _retire(self, slot: Slot, add: bool) -> None:
        """Out of the loop: its slots freed now; its close packet and dead letters go with the sender."""
        gen = slot.gen
        if add:
            self.slots.pop(gen.sid, None)
        self.rt.slot_freed()  # on every loop of this head: its caches are shared
        try:
            gen.release()
        except Exception:
            log.exception("session %s: could not release its caches", gen.sid)
        self.receiver.unwatch(gen.refusals.stream)
        bye = gen.goodbye()
        dead = [
            (gen.names.dead_letters, d) for d in gen.refusals.take_dead() if self.dead_cap.allow(gen.refusals.stream)
        ]
        if bye is not None or dead:
            self.sender.put(Outgoing([bye] if bye is not None else [], dead=dead))
