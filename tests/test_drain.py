"""`take_queued` (workers/drain.py): one wait, then everything queued by then, in order, up to a limit."""

from __future__ import annotations

import queue
import threading

from workers.drain import take_queued


def test_it_takes_what_is_queued_in_order_up_to_the_limit() -> None:
    q: queue.Queue[int] = queue.Queue()
    for i in range(5):
        q.put(i)
    assert take_queued(q, 3) == [0, 1, 2]
    assert take_queued(q) == [3, 4]


def test_it_waits_for_the_first() -> None:
    q: queue.Queue[str] = queue.Queue()
    threading.Timer(0.05, q.put, ("late",)).start()
    assert take_queued(q) == ["late"]
