"""Which generations submitted to the head's step loop (workers/head/loop.py) can begin now: each needs a cache slot
of its length (`RoundLoop.seat`: a short slot where its prompt, new tokens and drafts fit one). One that no free slot
fits waits, in submission order, until a generation ends, rather than taking a spare pool beyond the worker's memory
plan: a batch of jobs longer than the short slots shares the full-length ones. One its job's user cancels while it waits
ends then (`withdraw`), not once seated."""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Protocol, TypeVar

from rq.timeouts import JobTimeoutException

log = logging.getLogger("shardflow.head")


# What this module reads of the loop's slots (workers/head/loop.py's `Slot`), as protocols: the loop imports this
# module, so it does not import the loop.
class Generation(Protocol):
    """A generation on the loop (`RoundLoop`): whether it holds its cache slots, and how it takes and frees them."""

    @property
    def sid(self) -> str: ...

    @property
    def seated(self) -> bool: ...

    def seat(self, overflow: bool = True) -> bool: ...

    def release(self) -> None: ...


class Waiting(Protocol):
    """One of the loop's slots, as seating reads it: its generation, its caller's Future and its job's deadline."""

    @property
    def gen(self) -> Generation: ...

    @property
    def future(self) -> Future: ...

    @property
    def deadline(self) -> float | None: ...


S = TypeVar("S", bound=Waiting)


def seat(waiting: list[S], new: list[S], now: float, freed: bool) -> tuple[list[S], list[S]]:
    """(seated, still waiting) of the loop's `Slot`s, in order: the new ones, and those waiting where a slot was
    freed since (`freed`) or a deadline passed (otherwise none of them can be seated: no acquire a step for each).
    One past its deadline, or whose seating failed (a drafter its request names that this head lacks), holds
    nothing and is never watched: its Future hears why."""
    retry = freed or any(s.deadline is not None and now > s.deadline for s in waiting)
    seated, still = _seat(waiting + new if retry else new, now)
    return seated, still if retry else waiting + still


def _seat(slots: list[S], now: float) -> tuple[list[S], list[S]]:
    seated: list[S] = []
    still: list[S] = []
    for slot in slots:
        try:
            if slot.deadline is not None and now > slot.deadline:
                raise JobTimeoutException("the job ran past its timeout waiting for a cache slot")
            if not slot.gen.seated and not slot.gen.seat(overflow=False):
                still.append(slot)
                continue
        except BaseException as e:
            slot.gen.release()  # one seated when made (a direct RoundLoop) gives its slots back
            if not slot.future.done():
                slot.future.set_exception(e)
            continue
        seated.append(slot)
    return seated, still


def withdraw(lists: tuple[list[S], ...], cancels: list[tuple[Future, BaseException]]) -> tuple[list[S], ...]:
    """Each list of not yet seated `Slot`s without those whose Future `cancels` names, which end with its exception
    (a cancel for a generation seated already is dropped: it ends at its next progress flush)."""
    why = {id(f): e for f, e in cancels}
    if not why:
        return lists
    for slot in (s for slots in lists for s in slots if id(s.future) in why):
        try:  # one seated when made (a direct RoundLoop) gives its slots back, as in `_seat`
            slot.gen.release()
        except Exception:  # as `HeadLoop._retire`: logged, never a failure of the loop's other generations
            log.exception("session %s: could not release its caches", slot.gen.sid)
        if not slot.future.done():
            slot.future.set_exception(why[id(slot.future)])
    return tuple([s for s in slots if id(s.future) not in why] for slots in lists)
