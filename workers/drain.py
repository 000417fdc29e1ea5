"""Take everything queued at once: how the head's I/O threads (senders, flushers, finishers) batch their work into
one round trip each."""

from __future__ import annotations

import queue
from typing import TypeVar

T = TypeVar("T")


def take_queued(q: queue.Queue[T], limit: int | None = None) -> list[T]:
    """Wait for one item, then take whatever else is queued by then (at most `limit` in all)."""
    batch = [q.get()]
    while limit is None or len(batch) < limit:
        try:
            batch.append(q.get_nowait())
        except queue.Empty:
            break
    return batch
