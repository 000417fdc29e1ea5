"""The head's step loop: one thread owns every generation in flight on one Redis connection.

Each `step` reads top to bottom:
1. take what callers and the I/O threads brought (`_wait`: submissions, cancels, replies, failed sends; it sleeps
   while there is nothing to do, until the schedule's next deadline);
2. seat the waiting generations a cache slot of their length fits (workers/head/schedule.py), end the failed ones,
   hand each generation the replies that came for it (`Generation.take`: commits, streams text and progress through
   its callback, waits after a full tail's "busy", replays after a tail's error or silence), end the expired ones,
   and send again the rounds a full tail refused once their wait is over;
3. compute one group of the READY generations (`Batcher.launch`, `read_drafts`, `collect`: workers/head/batching.py),
   taking the replies for the other generations while the device runs, and making the rounds' headers once the
   drafts are known;
4. queue the group to a sender thread, which seals each round (a frozen `Outbound`, workers/head/sealing.py) and
   publishes one entry per tail stream (schemas/groups.py).

The loop never waits on Redis: sender threads publish what it queues, receivers read the head's own reply stream
(workers/head/relay_io.py); both only move bytes and report back through `_inbox`. A generation's state changes on
this thread only. No thread per generation: callers submit a `Generation` and get its Future.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import redis

from relay_broker.budgets import DeadLetterCap
from schemas.requests import GenerationResult
from workers.head.batching import Launch
from workers.head.beacon import reply_group
from workers.head.core import Runtime
from workers.head.generation import MAX_HELD, Generation, Phase
from workers.head.relay_io import Outgoing, Receiver, Reply, Sender
from workers.head.schedule import Ended, Schedule
from workers.head.sealing import Outbound, seal_rounds
from workers.phases import PhaseClock

log = logging.getLogger("shardflow.head")


@dataclass
class Inbox:
    """What callers and the I/O threads brought since the loop last looked (guarded by the loop's condition)."""

    new: list[Generation] = field(default_factory=list)
    cancels: list[tuple[Future, BaseException]] = field(default_factory=list)
    replies: list[Reply] = field(default_factory=list)
    failed: list[tuple[list[str], BaseException]] = field(default_factory=list)  # (session ids, why) of failed sends
    freed: bool = False  # a generation of this head gave its slots back: the waiting ones try again
    replies_at: float | None = None  # when the oldest reply in it came from its reader

    def __bool__(self) -> bool:
        return bool(self.new or self.cancels or self.replies or self.failed or self.freed)


class HeadLoop:
    """Steps every generation submitted to it, on a thread of its own (see the module docstring)."""

    def __init__(self, runtime: Runtime, r: redis.Redis) -> None:
        self.rt, self.r, self.settings = runtime, r, runtime.settings
        self.schedule = Schedule(runtime.batcher)
        self._inbox = Inbox()
        self._cv = threading.Condition()
        self.steps = 0
        self._aside = 0.0  # of the group being computed: the loop's own work while the device ran it
        self.clock = PhaseClock("head loop", log)  # where the loop's time goes, logged every 10 s
        self.seal_clock = PhaseClock("head senders", log)  # sealing a group's rounds, on the sender threads
        self.relay_clock = PhaseClock("head relay", log)  # a reply's wait from its reader to the loop ("lag")
        self.sender = Sender(r, self.settings, self.seal_clock, runtime.link)
        relay = self.settings.relay
        self.dead_cap = DeadLetterCap(relay.dead_letter_rate, relay.dead_letter_burst)  # counted in relay_clock's lines
        self._epochs = 0  # the beacons' reply-stream moves the generations in flight have followed
        group = reply_group(runtime.beacons.ref)
        self.receiver = Receiver(r, self.settings, self._deliver, self.sender, group=group, dead_cap=self.dead_cap)
        threading.Thread(target=self._run, daemon=True, name="head-loop").start()

    # --- what other threads call: each only adds to the inbox ------------------------------------------
    def submit(self, gen: Generation, timeout_s: float | None = None) -> Future[GenerationResult]:
        """Run `gen` to its end; the Future holds its result or what failed it (a timeout: JobTimeoutException)."""
        gen.deadline = time.monotonic() + timeout_s if timeout_s is not None and timeout_s > 0 else None
        self._add(lambda box: box.new.append(gen))
        return gen.future

    def cancel(self, future: Future, why: BaseException) -> None:
        """End `future`'s generation with `why` if it still waits for a slot (seated: at its next progress flush)."""
        self._add(lambda box: box.cancels.append((future, why)))

    def slot_freed(self) -> None:  # a loop of this head gave cache slots back: generations waiting here try again
        self._add(lambda box: setattr(box, "freed", True))

    def _deliver(self, replies: list[Reply]) -> None:  # a receiver thread's replies
        def add(box: Inbox) -> None:
            box.replies_at = box.replies_at if box.replies else time.perf_counter()
            box.replies += replies

        self._add(add)

    def _send_failed(self, sids: list[str], e: BaseException) -> None:  # a sender thread's failure
        self._add(lambda box: box.failed.append((sids, e)))

    def _add(self, put: Callable[[Inbox], None]) -> None:
        with self._cv:
            put(self._inbox)
            self._cv.notify()

    # --- the loop -------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                self.step()
            except BaseException as e:  # a bug: every generation fails with it, the loop goes on
                log.exception("head loop: a step failed; failing the %d generations in flight", len(self.schedule.live))
                self._end_all([(gen, e) for gen in list(self.schedule.live.values())])

    def step(self) -> None:
        """One step of the loop (the module docstring)."""
        with self.clock("wait"):
            box = self._wait()
        self._follow_reply_streams()
        now = time.monotonic()
        with self.clock("admit"):
            self._end_all(self.schedule.withdraw(box.cancels))
            if box.freed:
                self.schedule.freed()
            seated, ended = self.schedule.admit(box.new, now)
            self._end_all(ended + self._begin(seated))
            self._end_all([(g, e) for sids, e in box.failed for g in self._live(sids)])
        with self.clock("replies"):
            self._take(box.replies)
        now = time.monotonic()
        self._end_all(self.schedule.expired(now))
        busy = self.schedule.resends(now)  # a full tail's wait over: the same rounds again
        self._send(busy, [g.resend() for g in busy])
        self.rt.link.in_flight(id(self), len(self.schedule.live))
        group = self.schedule.next_group(now)
        if group:
            with self.rt.lock:
                t0, self._aside = time.perf_counter(), 0.0
                launch = self.rt.batcher.launch([g.next_work() for g in group])  # drafts and lower shard queued
                self._take_meanwhile(0.0)  # the replies for the other generations, while the device runs
                self._poll(launch.drafts_ready)  # replies as they come, until the drafts are back
                self.rt.batcher.read_drafts(launch)  # drafts read; the hidden states' copy queued
                self._headers(group)  # the rounds' headers, made while the lower shard runs
                self._poll(launch.ready)  # replies as they come, until the device is done
                self.rt.batcher.collect(launch)  # hidden states on the host; a failed batch retried item by item
            self._computed(group, launch, time.perf_counter() - t0 - self._aside)
        self.steps += 1
        self._log()

    # --- step's parts ---------------------------------------------------------------------------------
    def _wait(self) -> Inbox:
        """What the callers and I/O threads brought; sleeps while there is nothing to do."""
        with self._cv:
            while not self._inbox:
                wait = self.schedule.sleep_s(time.monotonic())
                if wait is not None and wait <= 0:
                    break
                self._cv.wait(wait)
            box, self._inbox = self._inbox, Inbox()
        self._lag(box.replies, box.replies_at)
        return box

    def _lag(self, replies: list[Reply], at: float | None) -> None:
        """How long the oldest of these replies waited for the loop since its reader had it."""
        if replies and at is not None:
            self.relay_clock.add("lag", time.perf_counter() - at)

    def _follow_reply_streams(self) -> None:
        """A beacon moved to a fresh reply stream (workers/head/beacon.py): every generation in flight reads it now,
        and its next round names it."""
        if self.rt.beacons.epochs == self._epochs:
            return
        self._epochs = self.rt.beacons.epochs
        for gen in self.schedule.live.values():
            reply_to = self.rt.beacons.reply_to(gen.names)
            if reply_to != gen.reply_to:
                self.receiver.unwatch(gen.reply_stream)
                gen.reply_to, gen.reply_stream = reply_to, gen.names.reply(reply_to)
                self.receiver.watch(gen.reply_stream, gen.names.dead_letters)

    def _begin(self, seated: list[Generation]) -> list[Ended]:
        """Seated generations start: their reply stream watched; one whose checkpoint already ends it ends."""
        ended: list[Ended] = []
        for gen in seated:
            gen.reply_to = self.rt.beacons.reply_to(gen.names)  # its beacon was ensured when it was made
            gen.reply_stream = gen.names.reply(gen.reply_to)  # where its dead letters say the reply was
            self.receiver.watch(gen.reply_stream, gen.names.dead_letters)
            try:
                if gen.begin() is not None:  # a checkpoint that already ends the generation
                    self._end(gen)
            except BaseException as e:
                ended.append((gen, e))
        return ended

    def _live(self, sids: list[str]) -> list[Generation]:
        return [g for sid in sids if (g := self.schedule.live.get(sid)) is not None]

    def _take_meanwhile(self, wait_s: float) -> None:
        """While the device runs a group: the replies that came (within `wait_s` if none has), handed out now. The
        group's own generations are READY: theirs are held for them. Failed sends wait for the next step. Only the
        time spent handing replies out is the loop's own (`_aside`): a wait for one is the device's time, which the
        group plan must see as the group's compute (counted as loop work, groups look cheap and the plan splits them
        too finely; the likely part of 256 jobs running 10% slower on an H100 at 2026-12-08's d2d9651)."""
        with self._cv:
            if wait_s > 0 and not self._inbox.replies:
                self._cv.wait(wait_s)
            replies, at = self._inbox.replies, self._inbox.replies_at
            self._inbox.replies, self._inbox.replies_at = [], None
        self._lag(replies, at)
        if replies:
            t0 = time.perf_counter()
            self._take(replies)
            self._aside += (dt := time.perf_counter() - t0)
            self.clock.add("replies", dt)

    def _poll(self, ready: Callable[[], bool]) -> None:
        """Until the device has passed the group's drafts, or the group: each reply taken as it comes (within
        `relay.head_wait_poll_ms`), not after the wait. 0: the wait blocks in the batcher."""
        poll_s = self.settings.relay.head_wait_poll_ms / 1000
        while poll_s > 0 and not ready():
            self._take_meanwhile(poll_s)

    def _headers(self, group: list[Generation]) -> None:
        """Each greedy round's header, made while the device computes the group's hidden states (its drafts known):
        `Generation.prepare`. One that cannot be made now is made, or fails, when the round goes out."""
        t0 = time.perf_counter()
        for gen in group:
            work = gen.round.work if gen.round is not None else None
            if work is None or work.draft is None or work.error is not None or not work.sampling.greedy:
                continue
            try:
                gen.prepare()
            except Exception:
                log.debug("head: a round's header could not be made ahead; it is made when sent", exc_info=True)
        self._aside += (dt := time.perf_counter() - t0)
        self.clock.add("headers", dt)

    def _computed(self, group: list[Generation], launch: Launch, spent: float) -> None:
        """The group is computed: its time noted to the group plan, a round that failed ends its generation, the
        rest go out."""
        self.rt.batcher.plan.note_batch(len(group), spent)
        self.clock.add("compute", spent)
        self._end_all([(g, w.error) for g, w in zip(group, launch.batch, strict=True) if w.error is not None])
        ok = [g for g, w in zip(group, launch.batch, strict=True) if w.error is None]
        made: list[Generation] = []
        outs: list[Outbound] = []
        for gen in ok:
            try:
                outs.append(gen.outbound())
                made.append(gen)
            except Exception as e:  # its fields cannot be made: it fails alone
                self._end(gen, e)
        self._send(made, outs)

    def _send(self, gens: list[Generation], outs: list[Outbound]) -> None:
        """These rounds to a sender thread, which seals and publishes them (a round that cannot be sealed, or a
        publish that fails, comes back as a failed send)."""
        if not gens:
            return
        for gen in gens:
            gen.sent()
            if gen.held:  # entries that came while it was READY (none can answer this round yet)
                self._take_held(gen)
        relay, clock = self.settings.relay, self.seal_clock

        def build() -> list[tuple[str, dict]]:  # on the sender's thread: frozen values in, entries out
            t0 = time.perf_counter()
            entries, bad = seal_rounds(outs, relay)
            for out in bad:
                assert out.mac.exception() is not None
                self._send_failed([out.sid], out.mac.exception())  # type: ignore[arg-type]
            clock.add("seal", time.perf_counter() - t0)
            return entries

        sids, rows = [out.sid for out in outs], sum(out.rows for out in outs)
        self.sender.put(Outgoing([], on_error=lambda e: self._send_failed(sids, e), build=build, rows=rows))

    # --- replies --------------------------------------------------------------------------------------
    def _take(self, replies: list[Reply]) -> None:
        touched: list[Generation] = []
        for sid, entry_id, fields in replies:
            gen = self.schedule.live.get(sid) if sid is not None else None
            if gen is None:  # a session that ended (a late duplicate), or junk naming none: nothing to do
                log.debug("head: a reply for no session in flight (%s)", sid)
                continue
            gen.held.append((entry_id, fields))
            touched.append(gen)
        for gen in dict.fromkeys(touched):
            self._take_held(gen)

    def _take_held(self, gen: Generation) -> None:
        dead: list[tuple[str, dict]] = []
        while gen.held and gen.phase in (Phase.IN_FLIGHT, Phase.BUSY):
            entry_id, fields = gen.held.pop(0)
            if gen.phase is Phase.BUSY:
                continue  # the round it answered goes again: a later reply answers that
            try:
                record = gen.take(entry_id, fields)
            except BaseException as e:
                self._end(gen, e)
                break
            if record is not None and self.dead_cap.allow(gen.reply_stream):
                dead.append((gen.names.dead_letters, record))
            if gen.finish is not None:
                self._end(gen)
        # what is left (READY) is checked against its next round once sent: stale dropped, forged dead-lettered
        del gen.held[:-MAX_HELD]
        if dead:
            self.sender.put(Outgoing([], dead=dead))

    # --- ends -----------------------------------------------------------------------------------------
    def _end_all(self, ended: list[Ended]) -> None:
        for gen, e in ended:
            self._end(gen, e)

    def _end(self, gen: Generation, error: BaseException | None = None) -> None:
        """DONE: out of the schedule, its slots freed now, its close packet with the sender, its Future resolved."""
        if gen.phase is Phase.DONE:
            return  # ended already (a round that could not be sealed, then its group's send failed too)
        result: GenerationResult | None = None
        if error is None:
            try:
                result = gen.result()
            except BaseException as e:
                error = e
        seated = self.schedule.remove(gen) or gen.phase is not Phase.WAITING
        try:
            gen.release()
        except Exception:
            log.exception("session %s: could not release its caches", gen.sid)
        if seated:
            self.rt.slot_freed()  # on every loop of this head: its caches are shared
            self.receiver.unwatch(gen.reply_stream)
            if bye := gen.goodbye():
                self.sender.put(Outgoing(bye))
        if gen.future.done():
            return
        if error is not None or result is None:
            gen.future.set_exception(error or RuntimeError("a generation ended without a result"))
        else:
            gen.future.set_result(result)

    def _log(self) -> None:
        self.clock.maybe_log()
        self.seal_clock.maybe_log()
        written, dropped = self.dead_cap.take_counts()
        self.relay_clock.count("dead letters", written)
        self.relay_clock.count("dead letters dropped", dropped)
        self.relay_clock.maybe_log()
