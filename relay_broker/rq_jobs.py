"""RQ's Job, hardened for records anyone able to write RQ's keys could have forged.

RQ imports whatever function name a job record holds, and restores every field of it with no mercy for
bad values. `SafeJob` (every ShardFlow process reads jobs through it, producers and `rq` alike:
`--job-class relay_broker.rq_jobs.SafeJob`):
- imports nothing: a job's function is looked up by name in the class's `functions` registry (empty
  here; the head worker's subclass holds the one job function), and callbacks never run;
- restores a record whose fields do not parse as a bare job whose function is refused, so RQ fails it the
  usual way (failed registry, expiring) instead of the error ending a worker's loop, its maintenance or
  its scheduler; a key that is no hash is no job (RQ skips it);
- drops a rate limit (ShardFlow sets none; RQ would run Lua for it, which no role but admin may) and gives
  a record without TTLs the default result TTL (RQ keeps such failed jobs a year, results forever).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import redis
from rq.exceptions import NoSuchJobError
from rq.job import Job

from schemas.jobs import job_ttl
from schemas.settings import JobSettings

log = logging.getLogger("shardflow.rq_jobs")


class ForbiddenJobFunction(Exception):
    """A job record names a function outside the allow-list, or a callback, or does not parse."""


class SafeJob(Job):
    """A Job that never imports the code its record names (see the module docstring)."""

    functions: ClassVar[Mapping[str, Callable[..., Any]]] = {}
    # a record's result TTL where it has none usable: the documented jobs.result_ttl_s (a head's class: its own)
    fallback_ttl_s: ClassVar[int] = JobSettings().result_ttl_s
    _unreadable: str | None = None  # why the record did not restore

    @property
    def func(self) -> Any:
        if self._unreadable is not None:
            raise ForbiddenJobFunction(f"job record unreadable ({self._unreadable}); refused")
        fn = self.functions.get(self.func_name or "") if self.instance is None else None
        if fn is None:
            log.error("refused job %s: function %r is not allow-listed", self.id, self.func_name)
            raise ForbiddenJobFunction(f"job function {self.func_name!r} is not allow-listed; refused")
        return fn

    def _refuse_callback(self, kind: str) -> None:
        name = getattr(self, f"_{kind}_callback_name", None)
        if name is not None:
            log.error("refused job %s: %s callback %r is not allow-listed", self.id, kind, name)
            raise ForbiddenJobFunction(f"{kind} callback {name!r} is not allow-listed; refused")

    @property
    def success_callback(self) -> Any:
        self._refuse_callback("success")
        return None

    @property
    def failure_callback(self) -> Any:
        return None  # the job fails anyway; never import the named code

    @property
    def stopped_callback(self) -> Any:
        self._refuse_callback("stopped")
        return None

    def refresh(self) -> None:
        """RQ's refresh; a key of another type than a job hash is no job at all (RQ then skips it)."""
        try:
            super().refresh()
        except redis.ResponseError as e:
            if "WRONGTYPE" not in str(e):
                raise
            raise NoSuchJobError(f"{self.key} is not a job record") from None

    def restore(self, raw: dict) -> None:
        """RQ's restore, never failing on a bad field (see the module docstring)."""
        try:
            super().restore(raw)
        except NoSuchJobError:
            raise  # no data at all: not a job (RQ skips it)
        except Exception as e:
            self._unreadable = f"{type(e).__name__}: {e}"[:500]
            log.error("job %s: its record does not restore (%s); failing it", self.id, self._unreadable)
            super().restore({k: v for k, v in raw.items() if k in (b"data", "data")})  # the rest: RQ's defaults
        self.result_ttl = job_ttl(self, self.fallback_ttl_s)
        if not (isinstance(self.failure_ttl, int) and self.failure_ttl > 0):
            self.failure_ttl = self.result_ttl
        if self.rate_limit_key or self.rate_limit_concurrency:
            log.warning("job %s: ignoring the rate limit its record names", self.id)
            self.rate_limit_key, self.rate_limit_concurrency = None, None
