"""The head's step loop: one thread owns every generation in flight on one Redis connection.

Each step it
1. admits the generations submitted since the last one (their first round carries the prompt, so prompts
   run batched with the other rounds of their group);
2. computes one group of the generations that are ready: drafts for all of them at once and the lower
   shard once over all of them (`Batcher.compute`, workers/head/batching.py), seals each round and
   publishes the group as one entry per tail stream (schemas/groups.py), in one round trip;
3. reads the reply streams of every generation waiting for a verdict in one round trip (blocking briefly
   only when nothing is ready to compute), commits the verdicts (which streams text and progress through
   each generation's callback), sends again the rounds a full tail answered "busy" once their wait is over,
   replays the sessions whose tail went silent, and retires finished generations.

Groups are sized from measured stage and link times (workers/head/groups.py: about live / G generations,
so that while one group computes, the others' rounds are on the wire). A CPU head lingers briefly for a
group's worth of ready generations (`Batcher.linger_s`). Nothing runs a thread per generation: callers
(the dispatcher's jobs, `generate`) submit a `RoundLoop` and get a Future. Generations never block the
loop; their state changes only on this thread once submitted.
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

from relay_broker.streams import publish_many, read_replies
from schemas.groups import pack_group
from schemas.requests import GenerationResult
from workers.head.rounds import Outcome, RoundLoop

log = logging.getLogger("shardflow.head")


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


class HeadLoop:
    """Steps every generation submitted to it, on a thread of its own (see the module docstring)."""

    def __init__(self, runtime, r: redis.Redis) -> None:
        self.rt, self.r, self.settings = runtime, r, runtime.settings
        self.slots: list[Slot] = []
        self._inbox: list[Slot] = []
        self._cv = threading.Condition()
        self.steps = 0
        self._thread = threading.Thread(target=self._run, daemon=True, name="head-loop")
        self._thread.start()

    def submit(self, gen: RoundLoop, timeout_s: float | None = None) -> Future[GenerationResult]:
        """Run `gen` to its end; the Future holds its result or what failed it (a timeout: JobTimeoutException)."""
        future: Future[GenerationResult] = Future()
        deadline = time.monotonic() + timeout_s if timeout_s is not None and timeout_s > 0 else None
        with self._cv:
            self._inbox.append(Slot(gen, future, deadline))
            self._cv.notify()
        return future

    @property
    def live(self) -> int:
        return len(self.slots)

    # --- the loop -------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                self._step()
            except BaseException as e:  # a transport error past its retries, say: every generation fails with it
                log.exception("head loop: a step failed; failing the %d generations in flight", len(self.slots))
                for slot in list(self.slots):
                    self._fail(slot, e)

    def _step(self) -> None:
        self._admit()
        now = time.monotonic()
        self._resend(now)
        ready = [s for s in self.slots if s.state is State.READY]
        size = math.ceil(max(len(self.slots), 1) / self.rt.batcher.plan.groups(len(self.slots)))
        linger = self._linger_s(ready, size, now)
        if ready and linger <= 0:
            self._compute(ready[:size])
            ready = ready[size:]
        self._read(block_s=0.0 if ready and linger <= 0 else self._block_s(linger))
        self._expire(time.monotonic())
        self.steps += 1

    def _admit(self) -> None:
        """Take new generations; with none in flight, wait for one (no Redis traffic while idle)."""
        with self._cv:
            while not self._inbox and not self.slots:
                self._cv.wait()
            new, self._inbox = self._inbox, []
        for slot in new:
            try:
                if slot.gen.begin() is not None:  # a checkpoint that already ends the generation
                    self._done(slot, add=False)
                    continue
            except BaseException as e:
                self._fail(slot, e, add=False)
                continue
            self.slots.append(slot)

    def _linger_s(self, ready: list[Slot], size: int, now: float) -> float:
        """How much longer a CPU head waits for a group's worth of ready generations (0: compute now)."""
        linger = self.rt.batcher.linger_s
        if linger <= 0 or not ready or len(ready) >= size or not any(s.state is State.SENT for s in self.slots):
            return 0.0
        bound = min(max(4 * linger, self.rt.batcher.plan.wait or 0.0), 50 * linger)
        return max(bound - (now - min(s.since for s in ready)), 0.0)

    def _block_s(self, linger: float) -> float:
        """How long the reply read may block: until the next deadline, a linger's end, or the poll period."""
        waits = [self.settings.head_poll_ms / 1000]
        waits += [s.due - time.monotonic() for s in self.slots if s.state is not State.READY]
        if linger > 0:
            waits.append(linger)
        with self._cv:
            if self._inbox:
                return 0.0
        return max(min(waits), 0.0)

    # --- compute and send -----------------------------------------------------------------------------
    def _compute(self, group: list[Slot]) -> None:
        works = [s.gen.next_work() for s in group]
        with self.rt.lock:
            t0 = time.perf_counter()
            self.rt.batcher.compute(works)
            self.rt.batcher.plan.note_batch(len(works), time.perf_counter() - t0)
        out: list[tuple[Slot, str, dict]] = []
        for slot, work in zip(group, works, strict=True):
            if work.error is not None:
                self._fail(slot, work.error)
                continue
            try:
                out.append((slot, slot.gen.stream, slot.gen.packet()))
            except Exception as e:
                self._fail(slot, e)
        self._send(out)

    def _send(self, out: list[tuple[Slot, str, dict]]) -> None:
        if not out:
            return
        try:
            publish_many(self.r, self._entries(out), maxlen=self.settings.request_stream_maxlen)
        except Exception as e:
            for slot, _, _ in out:
                self._fail(slot, e)
            return
        for slot, _, _ in out:
            slot.state, slot.due = State.SENT, slot.gen.sent()

    def _entries(self, out: list[tuple[Slot, str, dict]]) -> list[tuple[str, dict]]:
        """The stream entries for these rounds: one group entry per tail stream (one round goes alone)."""
        by_stream: dict[str, list[dict]] = {}
        for _, stream, fields in out:
            by_stream.setdefault(stream, []).append(fields)
        if not self.settings.group_messages:
            return [(stream, fields) for stream, rounds in by_stream.items() for fields in rounds]
        return [(stream, pack_group(rounds) if len(rounds) > 1 else rounds[0]) for stream, rounds in by_stream.items()]

    def _resend(self, now: float) -> None:
        """Rounds a full tail refused, whose wait is over: the same packets again."""
        due = [s for s in self.slots if s.state is State.BUSY and s.due <= now]
        self._send([(s, s.gen.stream, s.gen.round.fields) for s in due if s.gen.round is not None])

    # --- replies --------------------------------------------------------------------------------------
    def _read(self, block_s: float) -> None:
        waiting = [s for s in self.slots if s.state is State.SENT]
        if not waiting:
            if block_s > 0:
                with self._cv:
                    self._cv.wait(block_s)  # a busy tail's wait, or a linger: a submission wakes it
            return
        if not any(s.gen.reader.ready for s in waiting):
            block_ms = int(block_s * 1000)
            read_replies(
                self.r,
                [s.gen.reader for s in waiting],
                block_ms=block_ms if block_ms >= 1 else None,
                count=self.settings.reply_read_count,
            )
        for slot in waiting:
            self._take(slot)

    def _take(self, slot: Slot) -> None:
        reader = slot.gen.reader
        while reader.ready:
            try:
                outcome = slot.gen.take(reader.pop())
            except BaseException as e:
                self._fail(slot, e)
                return
            if outcome is Outcome.IGNORED:
                continue
            if outcome is Outcome.BUSY:
                slot.state, slot.due = State.BUSY, time.monotonic() + slot.gen.busy_wait_s()
            elif outcome is Outcome.FINISHED:
                self._done(slot)
            else:  # committed, or a replay: the next round is computed
                slot.state, slot.since = State.READY, time.monotonic()
            return

    def _expire(self, now: float) -> None:
        for slot in list(self.slots):
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
        self._retire(slot, add)
        if not slot.future.done():
            slot.future.set_exception(e)

    def _retire(self, slot: Slot, add: bool) -> None:
        if add and slot in self.slots:
            self.slots.remove(slot)
        try:
            slot.gen.close()
        except Exception:
            log.exception("session %s: could not close", slot.gen.sid)
