"""RQ's scheduler as a thread of the head worker, with its locks kept without Lua.

RQ's worker forks its scheduler (`RQScheduler.start()`), and that child holds a copy of the head's
memory and outlives it: a SIGKILL or an out-of-memory kill of the head leaves the scheduler re-parented
to init, still holding `rq:scheduler-lock:QUEUE`. `ThreadScheduler` runs the same loop (acquire or
refresh the per-queue lock, heartbeat, move due jobs of the `ScheduledJobRegistry` onto their queue,
e.g. retries with a backoff interval) in a daemon thread of the head process, so nothing survives the
head, and stops on an event rather than on signals (a non-main thread cannot install handlers).

RQ takes, refreshes and releases these locks with Lua scripts (EVALSHA); the head's Redis user may not
run scripts (one `EVAL "while true do end" 0` would block Redis for everyone), so here a lock is
taken with `SET NX EX`, and refreshed or released only while it still holds this scheduler's name, by
an optimistic WATCH/MULTI/EXEC transaction. The lock lives a few seconds (`heartbeat_ttl_s`, at least
three scheduler intervals) instead of RQ's minute, so another head's worker takes over the queue's
schedule within seconds of this head dying (its maintenance restarts a scheduler that is not running).
"""

from __future__ import annotations

import logging
import math
import threading
from datetime import datetime
from typing import Any, Literal

import redis
from rq import Queue
from rq.exceptions import NoSuchJobError
from rq.scheduler import RQScheduler
from rq.utils import as_text, current_timestamp, now, utcformat

from relay_broker.rq_jobs import SafeJob
from schemas.settings import Settings

log = logging.getLogger("shardflow.scheduler")

LockOutcome = Literal["acquired", "refreshed", "taken"]
_WATCH_ATTEMPTS = 8  # a lock key changed under a WATCH this often in a row: treat it as another's


class ThreadScheduler(RQScheduler):
    """An `RQScheduler` that runs in a daemon thread of its worker and never runs Lua."""

    def __init__(self, *args: Any, settings: Settings | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shardflow_settings = settings or Settings()
        self._wake = threading.Event()
        self._process: threading.Thread | None = None  # RQ's worker checks `_process.is_alive()`

    @property
    def lock_ttl(self) -> int:
        """Seconds a lock (and the scheduler's record) outlives its last refresh."""
        return max(int(self.shardflow_settings.jobs.heartbeat_ttl_s), math.ceil(3 * self.interval), 2)

    # --- locks, without Lua ------------------------------------------------------------------------
    def _acquire_or_refresh(self, key: str) -> LockOutcome:
        """Take the lock if it is free, extend it if it is ours, else leave it to its owner."""
        for _ in range(_WATCH_ATTEMPTS):
            if self.connection.set(key, self.name, nx=True, ex=self.lock_ttl):
                return "acquired"
            with self.connection.pipeline() as pipe:
                try:
                    pipe.watch(key)
                    owner = pipe.get(key)
                    if owner is None:
                        continue  # expired between SET NX and WATCH: try to take it again
                    if as_text(owner) != self.name:
                        return "taken"
                    pipe.multi()
                    pipe.expire(key, self.lock_ttl)
                    pipe.execute()
                    return "refreshed"
                except redis.WatchError:
                    continue  # changed while we looked: look again
        return "taken"

    def _release(self, key: str) -> bool:
        """Delete the lock only while it still holds this scheduler's name."""
        for _ in range(_WATCH_ATTEMPTS):
            with self.connection.pipeline() as pipe:
                try:
                    pipe.watch(key)
                    owner = pipe.get(key)
                    if owner is None or as_text(owner) != self.name:
                        return False
                    pipe.multi()
                    pipe.delete(key)
                    pipe.execute()
                    return True
                except redis.WatchError:
                    continue
        return False

    def acquire_locks(self, auto_start: bool = False) -> set[str]:
        """RQ's `acquire_locks`, through `_acquire_or_refresh`; starts the thread if asked and it is not running."""
        owned = set()
        for name in self._queue_names:
            outcome = self._acquire_or_refresh(self.get_locking_key(name))
            if outcome != "taken":
                (log.info if outcome == "acquired" else log.debug)("scheduler lock for %s %s", name, outcome)
                owned.add(name)
        self._scheduled_job_registries = []
        self._acquired_locks = owned
        self.lock_acquisition_time = datetime.now()  # naive, as RQ's should_reacquire_locks reads it
        if owned and auto_start and (self._process is None or not self._process.is_alive()):
            self.start()
        return owned

    def release_locks(self) -> None:
        """Release the locks this scheduler still owns; others' are left alone."""
        for name in self._acquired_locks:
            self._release(self.get_locking_key(name))
        self._acquired_locks = set()

    def heartbeat(self) -> None:
        """Refresh the scheduler's record and its locks; drop the queues whose lock another has taken."""
        self.last_heartbeat = now()
        with self.connection.pipeline() as pipe:
            pipe.hset(self.key, "last_heartbeat", utcformat(self.last_heartbeat))
            pipe.expire(self.key, self.lock_ttl)
            pipe.execute()
        lost = set()
        for name in sorted(self._acquired_locks):
            outcome = self._acquire_or_refresh(self.get_locking_key(name))
            if outcome == "taken":
                lost.add(name)
            elif outcome == "acquired":
                log.warning("scheduler lock for %s had expired; re-acquired", name)
        if lost:
            log.warning("scheduler locks for %s were taken over by another scheduler", ", ".join(sorted(lost)))
            self._acquired_locks -= lost
            self._scheduled_job_registries = []

    def save(self, pipeline: redis.client.Pipeline | None = None) -> None:
        """RQ's record of this scheduler, with the lock's TTL."""
        conn = pipeline if pipeline is not None else self.connection.pipeline()
        conn.hset(self.key, mapping=self.to_dict())
        conn.expire(self.key, self.lock_ttl)
        if pipeline is None:
            conn.execute()

    def enqueue_scheduled_jobs(self) -> None:
        """RQ's, with every due record read through `SafeJob` (RQ restores them with its plain Job, so one
        forged entry of `rq:scheduled:QUEUE` would raise and hold back every due retry of that queue): a
        record that does not parse is enqueued as a bare job RQ then fails the usual way, a key that is no
        job is dropped from the registry."""
        self._status = self.Status.WORKING
        if not self._scheduled_job_registries and self._acquired_locks:
            self.prepare_registries()
        for registry in self._scheduled_job_registries:
            job_ids = registry.get_jobs_to_schedule(current_timestamp())
            if not job_ids:
                continue
            queue = Queue(registry.name, connection=self.connection, serializer=self.serializer, job_class=SafeJob)
            with self.connection.pipeline() as pipe:
                for job_id in job_ids:
                    job = self._fetch(job_id)
                    if job is not None:
                        queue._enqueue_job(job, pipeline=pipe, at_front=job.should_enqueue_at_front())
                    registry.remove(job_id, pipeline=pipe)
                pipe.execute()
        self._status = self.Status.STARTED

    def _fetch(self, job_id: str) -> SafeJob | None:
        try:
            return SafeJob.fetch(job_id, connection=self.connection, serializer=self.serializer)
        except NoSuchJobError:
            return None

    # --- the thread ---------------------------------------------------------------------------------
    def start(self) -> threading.Thread:  # type: ignore[override]
        """Run `work()` in a daemon thread of this process (RQ forks a process here)."""
        self._status = self.Status.STARTED
        self._stop_requested = False
        self._wake.clear()
        self._process = threading.Thread(target=self._run, name="rq-scheduler", daemon=True)
        self._process.start()
        return self._process

    def _run(self) -> None:
        log.info("scheduler for %s started (thread)", ", ".join(sorted(self._queue_names)))
        try:
            self.work()
        except Exception:  # the worker's maintenance starts it again while it holds or can take the lock
            log.exception("scheduler for %s stopped on an error", ", ".join(sorted(self._queue_names)))

    def work(self) -> None:
        """RQ's scheduler loop without signal handlers: stops when `request_stop` is called."""
        self.register_birth()
        while not self._stop_requested:
            try:
                if self.should_reacquire_locks:
                    self.acquire_locks()
                self.heartbeat()
                self.enqueue_scheduled_jobs()
            except (redis.ConnectionError, redis.TimeoutError) as e:  # Redis away: keep trying each interval
                log.warning("scheduler: Redis lost (%s)", e)
            except Exception as e:  # a scheduled entry it cannot handle: the other queues' jobs go on next time
                log.error("scheduler: %r", e)
            self._wake.wait(self.interval)
        try:
            self.stop()
        except redis.RedisError as e:  # the locks expire on their own
            log.warning("scheduler: could not release its locks (%s)", e)

    def request_stop(self, signum: int | None = None, frame: object = None) -> None:
        """Ask the loop to release its locks and end (it wakes at once)."""
        self._stop_requested = True
        self._wake.set()

    def join(self, timeout: float) -> None:
        """Stop the thread and wait for it up to `timeout` seconds."""
        self.request_stop()
        thread = self._process
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
