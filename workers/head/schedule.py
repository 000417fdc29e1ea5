"""The head loop's schedule: which generations wait for a cache slot, which are live, and what each step does with
them. Only the loop's thread (workers/head/loop.py) calls it; it decides, the loop acts (computes, sends, ends).

- **Seating** (`admit`): a generation needs a cache slot of its length (`Generation.seat`: a short slot where its
  prompt, new tokens and drafts fit one). One that no free slot fits waits, in submission order, until a generation
  ends (`freed`), rather than taking a spare pool beyond the worker's memory plan: a batch of jobs longer than the
  short slots shares the full-length ones. One its job's user cancels while it waits ends then (`withdraw`).
- **Deadlines** (`expired`, `resends`): a job's timeout; a verdict later than the reply timeout (a replay, READY);
  a full tail's wait that is over (BUSY: the same round again).
- **The next group** (`next_group`): about live / G of the READY generations, G from `GroupPlan` (workers/head/
  groups.py: measured compute and round waits). A CPU head lingers briefly for a group's worth of ready ones
  (`Batcher.linger_s`): on a CPU a batched forward costs little more than one sequence's, so generations that fell
  out of step cost more than one wait that puts them back in step.
- **Sleep** (`sleep_s`): 0 with a group to compute, else until the next deadline.
"""

from __future__ import annotations

import math
from concurrent.futures import Future

from rq.timeouts import JobTimeoutException

from workers.head.batching import Batcher
from workers.head.generation import Generation, Phase

Ended = tuple[Generation, BaseException]  # a generation to end with this error


class Schedule:
    """The generations of one head loop: `waiting` (no cache slot yet, in submission order) and `live` (seated, by
    session id), with the decisions above."""

    def __init__(self, batcher: Batcher) -> None:
        self.batcher = batcher
        self.waiting: list[Generation] = []
        self.live: dict[str, Generation] = {}
        self._freed = False  # a generation ended since the last seating: the waiting ones try again

    def freed(self) -> None:
        """A generation (of this loop or another of this head: their caches are shared) gave its slots back."""
        self._freed = True

    def admit(self, new: list[Generation], now: float) -> tuple[list[Generation], list[Ended]]:
        """(seated, ended): the new ones, and the waiting ones where a slot was freed since or a deadline passed
        (otherwise none of them can be seated: no acquire a step for each). The seated ones are live and READY; one
        past its deadline, or whose seating failed (a drafter its request names that this head lacks), ends."""
        retry = self._freed or any(g.deadline is not None and now > g.deadline for g in self.waiting)
        seated: list[Generation] = []
        ended: list[Ended] = []
        still: list[Generation] = []
        for gen in self.waiting + new if retry else new:
            try:
                if gen.deadline is not None and now > gen.deadline:
                    raise JobTimeoutException("the job ran past its timeout waiting for a cache slot")
                if not gen.seat(overflow=False):
                    still.append(gen)
                    continue
            except BaseException as e:
                ended.append((gen, e))
                continue
            seated.append(gen)
            self.live[gen.sid] = gen
        self.waiting = still if retry else self.waiting + still
        self._freed = False
        return seated, ended

    def withdraw(self, cancels: list[tuple[Future, BaseException]]) -> list[Ended]:
        """The waiting generations whose Future `cancels` names, out of the schedule, to end with its error (a cancel
        for a generation seated already is dropped: it ends at its next progress flush)."""
        why = {id(f): e for f, e in cancels}
        ended = [(g, why[id(g.future)]) for g in self.waiting if id(g.future) in why]
        self.waiting = [g for g in self.waiting if id(g.future) not in why]
        return ended

    def remove(self, gen: Generation) -> bool:
        """Out of the schedule (it ends); whether it was live."""
        if self.live.get(gen.sid) is gen:
            del self.live[gen.sid]
            return True
        if gen in self.waiting:
            self.waiting.remove(gen)
        return False

    def expired(self, now: float) -> list[Ended]:
        """Live generations past their job's timeout, or past their reply timeout with their replays used up; one
        whose verdict is late but may replay goes READY (`Generation.timed_out`)."""
        ended: list[Ended] = []
        for gen in self.live.values():
            if gen.deadline is not None and now > gen.deadline:
                ended.append((gen, JobTimeoutException("the job ran past its timeout")))
            elif gen.phase is Phase.IN_FLIGHT and now > gen.due:
                try:
                    gen.timed_out()
                except BaseException as e:
                    ended.append((gen, e))
        return ended

    def resends(self, now: float) -> list[Generation]:
        """BUSY generations whose wait for a full tail is over: their round goes again."""
        return [g for g in self.live.values() if g.phase is Phase.BUSY and g.due <= now and g.round is not None]

    def next_group(self, now: float) -> list[Generation]:
        """The READY generations to compute now (about live / G of them), or none while a CPU head lingers."""
        ready = [g for g in self.live.values() if g.phase is Phase.READY]
        size = self._group_size()
        return ready[:size] if ready and self._linger_s(ready, size, now) <= 0 else []

    def sleep_s(self, now: float) -> float | None:
        """How long the loop may sleep: 0 with a group to compute (past any linger), else until the next deadline
        (None: until something comes)."""
        ready = [g for g in self.live.values() if g.phase is Phase.READY]
        if ready:
            return self._linger_s(ready, self._group_size(), now)
        dues = [g.due for g in self.live.values()]
        dues += [g.deadline for g in (*self.live.values(), *self.waiting) if g.deadline]  # a waiting one's timeout too
        return max(min(dues) - now, 0.0) if dues else None  # 0: a deadline has come (a resend, a timeout)

    def _group_size(self) -> int:
        live = max(len(self.live), 1)
        return math.ceil(live / self.batcher.plan.groups(len(self.live)))

    def _linger_s(self, ready: list[Generation], size: int, now: float) -> float:
        """How much longer a CPU head waits for a group's worth of ready generations (0: compute now)."""
        linger = self.batcher.linger_s
        if linger <= 0 or len(ready) >= size or not any(g.phase is Phase.IN_FLIGHT for g in self.live.values()):
            return 0.0
        bound = min(max(4 * linger, self.batcher.plan.wait or 0.0), 50 * linger)
        return max(bound - (now - min(g.since for g in ready)), 0.0)
