"""How many groups the head splits its generations in flight into, from measured stage and link times.

With every sequence in one batch, the head's GPU idles while that batch's packets travel to the tail and
back. Split into G groups of about n / G sequences, one group drafts and runs its layers while the others'
packets are on the wire; a group's round then takes T(G) = max(h(n / G) + W, G * h(n / G)), with h(b) the
head's compute for a batch of b (drafting and the lower shard) and W the wait from publishing a round to
its verdict (link, queueing and the tail's compute). The aggregate goes as n / T(G), so the plan picks the
G of smallest T (a larger G only when it is clearly better: smaller batches use the GPU less well).

h is measured per batch-size bucket (powers of two, as graphs are captured) and W per round, both as moving
averages. A bucket not yet measured but half of a measured one is estimated from it by the ratio halving has
shown so far, or at half its time before any halving is measured: optimistic (its fixed costs are left out),
so the plan tries that split, measures it, and keeps it only if it pays.
"""

from __future__ import annotations

import math
import threading

MAX_GROUPS = 4
FIRST_GROUP_MIN = 16  # before anything is measured, generations are split only into groups at least this large
GAIN = 0.95  # a larger G is taken only if its round is at least 5% shorter
SMOOTH = 0.2  # weight of a new measurement in the moving averages


def bucket(b: int) -> int:
    """The power of two at or above b."""
    return 1 << max(b - 1, 0).bit_length()


class GroupPlan:
    """Measured head compute per batch bucket and round wait; `groups(n)` picks the number of groups."""

    def __init__(self, max_groups: int = MAX_GROUPS, fixed: int | None = None) -> None:
        self.max_groups, self.fixed = max_groups, fixed
        self.compute: dict[int, float] = {}  # batch bucket -> seconds
        self.wait: float | None = None  # seconds from publishing a round to its verdict
        self._lock = threading.Lock()

    def note_batch(self, size: int, seconds: float) -> None:
        with self._lock:
            b = bucket(size)
            old = self.compute.get(b)
            self.compute[b] = seconds if old is None else old + SMOOTH * (seconds - old)

    def note_wait(self, seconds: float) -> None:
        with self._lock:
            self.wait = seconds if self.wait is None else self.wait + SMOOTH * (seconds - self.wait)

    def estimate(self, size: int) -> float | None:
        """Head compute for a batch of `size`: measured for its bucket; for a bucket half of a measured one, half
        of that (a split is tried one halving at a time); above every measured one, scaled up from the largest."""
        b = bucket(size)
        if b in self.compute:
            return self.compute[b]
        if 2 * b in self.compute:  # as much cheaper as halving has measured (half, until measured)
            halvings = [self.compute[m] / self.compute[2 * m] for m in self.compute if 2 * m in self.compute]
            return self.compute[2 * b] * min(max(halvings, default=0.5), 1.0)
        if self.compute and b > (top := max(self.compute)):
            return self.compute[top] * b / top
        return None

    def round_time(self, live: int, g: int) -> float | None:
        h = self.estimate(math.ceil(live / g))
        return None if h is None or self.wait is None else max(h + self.wait, g * h)

    def groups(self, live: int) -> int:
        """Groups for `live` generations in flight (`fixed` if set). Until both stages are measured: as many as
        keep FIRST_GROUP_MIN in each, up to max_groups (a batch of jobs' first rounds, their prompts, then go out
        a group at a time while the next computes, rather than all after the last prompt)."""
        if self.fixed is not None:
            return max(1, min(self.fixed, live))
        with self._lock:
            best, best_t = 1, self.round_time(live, 1)
            if best_t is None:
                return max(1, min(self.max_groups, live // FIRST_GROUP_MIN))
            for g in range(2, min(self.max_groups, live) + 1):
                t = self.round_time(live, g)
                if t is not None and t < GAIN * best_t:
                    best, best_t = g, t
            return best
