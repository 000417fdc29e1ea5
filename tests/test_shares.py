"""workers/shares.py: a batch's per-item work in contiguous shares, the caller's thread taking one."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest

from workers.shares import MIN_SHARE_BYTES, Shares


def _tagged(part: Sequence[int]) -> list[tuple[int, str]]:
    return [(x, threading.current_thread().name) for x in part]


def test_shares_keep_order_and_run_beside_the_caller() -> None:
    shares = Shares(4, "t-share")
    got = shares.map(_tagged, list(range(10)), 10 * MIN_SHARE_BYTES)
    assert [x for x, _ in got] == list(range(10))
    names = [name for _, name in got]
    assert set(names[:3]) == {threading.current_thread().name}  # the first share (ceil(10 / 4) items): the caller's
    assert all(n.startswith("t-share") for n in names[3:])  # the other three: the pool's


@pytest.mark.parametrize(("threads", "items", "nbytes"), [(4, 10, MIN_SHARE_BYTES), (1, 10, 1 << 40), (4, 1, 1 << 40)])
def test_small_batches_run_on_the_caller_alone(threads: int, items: int, nbytes: int) -> None:
    got = Shares(threads, "t-small").map(_tagged, list(range(items)), nbytes)
    assert {name for _, name in got} == {threading.current_thread().name}


def test_an_error_in_one_share_is_raised_after_every_share_ended() -> None:
    ended: list[int] = []

    def fn(part: Sequence[int]) -> list[int]:
        if 7 in part:
            raise ValueError("share with 7")
        ended.extend(part)
        return list(part)

    with pytest.raises(ValueError, match="share with 7"):
        Shares(3, "t-err").map(fn, list(range(9)), 9 * MIN_SHARE_BYTES)
    assert sorted(ended) == list(range(6))  # the other two shares ran to their end
