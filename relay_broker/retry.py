"""Riding out a lost Redis: the one backoff every loop that must outlive Redis going away uses (a tail's
serve loop, a head worker's RQ loop, a producer's `--wait` / `--follow`), built on tenacity.

Single Redis operations retry transport errors with `connection.transport_retry` (a few quick attempts);
`ride_out` is for whole loops: it keeps retrying, waiting `reconnect_min_s` doubling up to
`reconnect_max_s` (schemas/settings.py), until the call succeeds, a deadline passes, or `stop()` says so.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from tenacity import RetryCallState, Retrying, retry_if_exception_type, wait_exponential

from relay_broker.connection import TRANSPORT_ERRORS
from schemas.errors import TransportError
from schemas.settings import Settings

T = TypeVar("T")
REDIS_LOST = (*TRANSPORT_ERRORS, TransportError)


def backoff(settings: Settings) -> wait_exponential:
    """reconnect_min_s, doubling up to reconnect_max_s."""
    return wait_exponential(multiplier=settings.redis.reconnect_min_s, max=settings.redis.reconnect_max_s)


def ride_out(
    fn: Callable[[], T],
    *,
    errors: tuple[type[BaseException], ...] = REDIS_LOST,
    deadline: float | None = None,
    stop: Callable[[], bool] | None = None,
    on_retry: Callable[[BaseException, float], None] | None = None,
    sleep: Callable[[float], object] = time.sleep,
    wait: Callable[[RetryCallState], float] | None = None,
    settings: Settings | None = None,
) -> T:
    """fn(), retried while it raises one of `errors`, with `backoff(settings)` (or `wait`) between attempts, until it
    returns; past `deadline` (time.monotonic()) or once `stop()` is true the last error is raised.
    `on_retry(error, seconds)` hears of each retry before its wait; `sleep` waits (an Event's `wait` ends
    the wait early when the event is set)."""

    def give_up(state: RetryCallState) -> bool:
        return (deadline is not None and time.monotonic() > deadline) or (stop is not None and stop())

    def before_sleep(state: RetryCallState) -> None:
        if on_retry is not None and state.outcome is not None and state.next_action is not None:
            on_retry(state.outcome.exception(), state.next_action.sleep)  # type: ignore[arg-type]

    retrying = Retrying(
        retry=retry_if_exception_type(errors),
        wait=wait or backoff(settings or Settings()),
        stop=give_up,
        before_sleep=before_sleep,
        sleep=sleep,
        reraise=True,
    )
    return retrying(fn)
