"""Waiting on and following jobs in the terminal, for the producer commands (producer/cli_jobs.py) and the
demo: `show_wait` (a progress bar or progress lines), `show_follow` / `follow_text` (the jobs' text in job
order as it commits). While either waits, stderr says when no head worker is live to run the jobs
(producer/head_watch.py)."""

from __future__ import annotations

import sys
from functools import partial

import click

from producer.client import (
    FINAL,
    Client,
    Followed,
    JobEnded,
    JobView,
    StreamBroken,
    TextChunk,
    WaitTimeout,
    summary,
)
from producer.head_watch import HeadWatch
from producer.options import EXIT_TIMEOUT, fail


def _say_retry(error: BaseException, seconds: float) -> None:
    """The Client's `on_retry` here: say on stderr that Redis is gone and when the next attempt is."""
    click.echo(f"Redis unreachable ({error}); retrying in {seconds:.1f}s", err=True)


def show_wait(client: Client, ids: list[str], timeout: float | None) -> list[JobView]:
    """`client.wait`, showing progress: a bar on a terminal, a line per change otherwise, and whether a head
    worker is live to run the jobs (producer/head_watch.py); exit 5 on timeout."""
    bar = None
    say = None
    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=len(ids), file=sys.stderr, unit="job", desc="generating")
        say = partial(tqdm.write, file=sys.stderr)  # a line above the bar, not through it
    last = ""

    def show(views: list[JobView]) -> None:
        nonlocal last
        done = sum(v.status in FINAL for v in views)
        if bar is not None:
            speed = sum(v.progress.get("tokens_per_s", 0) for v in views if v.status == "started")
            bar.n = done
            bar.set_postfix_str(f"{summary(views)}; {speed:.1f} tok/s", refresh=True)
        elif (line := f"progress: {done}/{len(ids)} done ({summary(views)})") != last:
            click.echo(line, err=True)
            last = line

    client.on_retry = _say_retry
    timed_out: WaitTimeout | None = None
    watch = HeadWatch(client, timeout, say)
    try:
        with watch:
            views = client.wait(ids, timeout=timeout, on_progress=show)
    except WaitTimeout as e:
        views, timed_out = e.views, e
    finally:
        if bar is not None:
            bar.close()
    if timed_out is not None:
        fail(f"{timed_out}{watch.note()}", EXIT_TIMEOUT)
    return views


def show_follow(client: Client, ids: list[str], timeout: float | None) -> list[JobView]:
    """`client.follow`, printing the jobs' text in job order as it commits: the first unfinished job's text
    live (after `[index] `), the text of jobs running beside it held until its turn (jobs run many at a
    time; their text never interleaves), and how jobs that end without their text ended; the views at the
    end; exit 5 on timeout. A job whose token stream broke (another client wrote it) is said so on stderr:
    the rest of its text comes from its stored result (see `follow_text` for a stream that is not its text)."""
    return follow_text(client, ids, timeout)[0]


def follow_text(client: Client, ids: list[str], timeout: float | None) -> tuple[list[JobView], bool]:
    """`show_follow`, and whether all that was printed is the jobs' text: False when a job's token stream
    held text that is not its result's (said on stderr, with how to print the stored result). Whether a head
    worker is live to run the jobs is said on stderr too (producer/head_watch.py)."""
    client.on_retry = _say_retry
    shown = _InOrder(len(ids))
    views: list[JobView] = []
    true_text = True
    watch = HeadWatch(client, timeout)
    try:
        with watch:
            for event in client.follow(ids, timeout=timeout):
                if isinstance(event, TextChunk):
                    shown.add(event.index, event.text, event.last)
                elif isinstance(event, JobEnded):
                    v = event.view
                    ended = f"{v.status}: {v.error or ''}" if v.status != "finished" else ""
                    shown.add(v.index, ended, True, own_line=True)
                elif isinstance(event, StreamBroken):
                    true_text = true_text and event.repaired
                    _say_broken(event)
                elif isinstance(event, Followed):
                    views = event.views
    except WaitTimeout as e:
        fail(f"{e}{watch.note()}", EXIT_TIMEOUT)
    return views, true_text


def _say_broken(event: StreamBroken) -> None:
    v = event.view
    if event.repaired:
        click.echo(f"note: [{v.index}] {v.job_id}: {event.reason}; the rest of its text is from its result", err=True)
    else:
        click.echo(
            f"error: [{v.index}] {v.job_id}: {event.reason}; the text printed for it is not its result's "
            f"(`shardflow results {v.job_id}` prints that)",
            err=True,
        )


class _InOrder:
    """Prints jobs' text in index order: the current job's as it comes, later jobs' once it is their turn."""

    def __init__(self, n: int) -> None:
        self.held: list[list[str]] = [[] for _ in range(n)]
        self.ended = [False] * n
        self.had_text = [False] * n
        self.at, self.started = 0, False  # the job being printed; its `[index] ` is out

    def add(self, index: int, text: str, last: bool, own_line: bool = False) -> None:
        """Job `index`'s next text (`last`: its end); `own_line` text goes on a line of its own."""
        if not 0 <= index < len(self.held) or self.ended[index]:
            return
        if text and own_line and self.had_text[index]:
            text = "\n" + text
        self.had_text[index] = self.had_text[index] or bool(text)
        self.held[index].append(text)
        self.ended[index] = last
        while self.at < len(self.held):
            if not self.started:
                click.echo(f"[{self.at}] ", nl=False)
                self.started = True
            click.echo("".join(self.held[self.at]), nl=False)
            self.held[self.at] = []
            if not self.ended[self.at]:
                return
            click.echo("")
            self.at, self.started = self.at + 1, False
