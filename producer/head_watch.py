"""Saying, while the CLI waits on jobs (`--wait`, `--follow`), that no head worker is live to run them: the look
`shardflow serve` takes before it enqueues (producer/liveness.py), taken here on a thread of its own, so that a
user whose queue no head serves is told so on stderr within seconds instead of waiting in silence.

    with HeadWatch(client, timeout) as watch:    # on stderr, once the wait has lasted GRACE_S with no live head:
        views = client.wait(ids)                 #   warning: no head worker is running for queue shardflow
                                                 #   (start one: shardflow head); still waiting (Ctrl-C to stop)

The wait goes on (its `--timeout`, if given, still ends it: `watch.note()` adds why to its message). A head that
comes afterwards is said too. The first look is taken only once the wait has lasted GRACE_S: a wait that ends
sooner reads nothing more, and a head started just before the waiting command has time to beat. The look is
advisory: one that fails (Redis lost, which the wait itself rides out and reports) is skipped.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from types import TracebackType

import click

from producer.client import Client
from producer.liveness import Liveness

GRACE_S = 2.0  # how long a wait runs before its first look at the queue's heads
EVERY_S = 0.5  # how often the thread looks after that (each look is cached for api.liveness_s, 1 s by default)

log = logging.getLogger("shardflow.cli")


def _say(line: str) -> None:
    click.echo(line, err=True)


class HeadWatch:
    """A thread that looks at the queue's head workers while a wait runs, and says on stderr (or through `say`)
    when none is live, and when one is live again after that; `timeout`: the wait's own, named in the warning."""

    def __init__(self, client: Client, timeout: float | None = None, say: Callable[[str], None] | None = None) -> None:
        self.liveness, self.queue, self.say = Liveness(client), f"queue {client.queue_name}", say or _say
        self.until = "" if timeout is None else f", for up to {timeout:g}s (--timeout)"
        self.why: str | None = None  # why no head is live, as of the last look (None: one is, or no look yet)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="head-watch", daemon=True)

    def __enter__(self) -> HeadWatch:
        self.thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.stop.set()
        self.thread.join(5)

    def note(self) -> str:
        """What to add to a timed-out wait's message: why no head ran its jobs ("" if one was live)."""
        return f"; {self.why}" if self.why else ""

    def _run(self) -> None:
        if self.stop.wait(GRACE_S):
            return
        while True:
            self.look()
            if self.stop.wait(EVERY_S):
                return

    def look(self) -> None:
        """One look; say so where it differs from the last one said (no live head, or one live again)."""
        try:
            why = self.liveness.look().why_not(self.queue)
        except Exception:  # Redis lost (the wait says so and rides it out) or a forged record: skip this look
            log.info("could not look at the head workers", exc_info=True)
            return
        if why is not None and self.why is None:
            self.say(f"warning: {why}; still waiting{self.until} (Ctrl-C to stop)")
        elif why is None and self.why is not None:
            self.say(f"note: a head worker now serves {self.queue}")
        self.why = why
