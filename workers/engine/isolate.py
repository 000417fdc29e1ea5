"""One bad sequence never fails a batch: run a batch together, and if that raises, run each item alone.

Both roles batch every ready sequence into one forward (the head's `Batcher`, the tail's rounds). An
exception there does not say which sequence caused it, so each item is rewound to the state it was
submitted in (its KV cache cropped back) and run alone; the item that fails alone gets its own error, as does one
that cannot be rewound (a long step wrote further into a windowed layer's ring than a rollback can undo).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def run_isolated(
    batch: list[T],
    run: Callable[[list[T]], list[R]],
    rewind: Callable[[T], None],
    on_error: Callable[[T, Exception], R],
) -> list[R]:
    """`run(batch)`, one result per item; if it raises, every item is rewound and run alone, and an item
    that fails alone gets `on_error(item, error)` as its result. Interrupts (BaseException) pass through."""
    try:
        return run(batch)
    except Exception as e:
        if len(batch) == 1:
            return [on_error(batch[0], e)]
    out: list[R] = []
    for item in batch:
        try:
            rewind(item)
        except Exception as e:  # its state cannot go back (a windowed layer's ring past its slack): it alone fails
            out.append(on_error(item, e))
            continue
        out += run_isolated([item], run, rewind, on_error)
    return out
