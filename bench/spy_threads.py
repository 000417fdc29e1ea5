"""Where a py-spy raw profile's samples go, by thread and by function (bench/spy.sh's spy-ROLE.txt).

    python -m bench.spy_threads spy-head.txt [--top 25] [--thread head-loop]

Prints each thread's share of the samples, then for the threads matching --thread (all, if not given) this
project's functions most often on the stack (inclusive: workers/, schemas/, relay_broker/, producer/) and the
functions most often running (the stack's last frame, any library). With `SPY_ARGS=--gil` the samples are those
holding the interpreter lock: the shares say which threads spend it.
"""

from __future__ import annotations

import collections
import re

import click

OURS = ("(workers/", "(schemas/", "(relay_broker/", "(producer/")


def _thread(frame: str) -> str:
    """'thread (123): head-sender-0' -> 'head-sender' (numbered pools counted together)."""
    name = frame.split(": ", 1)[-1]
    return re.sub(r"[-_]?\d+$", "", name)


@click.command()
@click.argument("path", type=click.Path(exists=True, dir_okay=False))
@click.option("--top", default=25, show_default=True, help="Functions to list.")
@click.option("--thread", "want", default="", help="Only threads whose name contains this.")
def main(path: str, top: int, want: str) -> None:
    threads: collections.Counter[str] = collections.Counter()
    funcs: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[str] = collections.Counter()
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            if not count.isdigit():
                continue
            n, frames = int(count), stack.split(";")
            total += n
            name = _thread(frames[0])
            threads[name] += n
            if want in name:
                for frame in set(frames[1:]):
                    if any(pkg in frame for pkg in OURS):
                        funcs[frame] += n
                leaves[frames[-1]] += n
    click.echo(f"{path}: {total} samples")
    for name, n in threads.most_common():
        click.echo(f"  {100 * n / max(total, 1):5.1f}%  {n:7d}  {name}")
    click.echo(f"functions of this project on the stack of threads matching {want!r}:")
    for frame, n in funcs.most_common(top):
        click.echo(f"  {100 * n / max(total, 1):5.1f}%  {frame[:150]}")
    click.echo(f"functions running in threads matching {want!r}:")
    for frame, n in leaves.most_common(top):
        click.echo(f"  {100 * n / max(total, 1):5.1f}%  {frame[:150]}")


if __name__ == "__main__":
    main()
