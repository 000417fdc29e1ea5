"""The head worker: an RQ worker that loads its models once and runs generation jobs in-process.

    shardflow head --target MODEL --layers 0:14 [--draft DRAFT] --queue shardflow --redis-url URL

RQ's default worker forks per job, which would lose loaded models and CUDA state; this is one
`SimpleWorker` per head process that (1) runs only allow-listed job functions (RQ would import any name a
job record holds, so anyone able to write to Redis could run code), (2) uses the JSON serializer (no
pickle), (3) replaces RQ's one-job-at-a-time loop with its `Dispatcher` (`workers/head/jobs/dispatcher.py`):
up to `--concurrency` jobs in flight at once (default: what the batch slots hold and a sixteenth more, which
wait for the next slot freed), each a generation on the head's step loop (workers/head/loop.py, one thread for
all of them), dequeued, started and finished in a few pipelined round trips,
while one housekeeping thread heartbeats the worker and every running job each `heartbeat_s` and runs
RQ's maintenance each `maintenance_s` (a killed head's jobs are retried within seconds, not minutes);
a job its user cancelled ends `canceled`, never failed, (4) announces its model so producers can check
prompts against the context length before enqueueing, (5) runs RQ's scheduler (which enqueues retries
when their backoff is due) as a thread of its own process, not a forked child, with its locks kept
without Lua (`workers/head/jobs/scheduler.py`): a SIGKILL or an out-of-memory kill of the head leaves no
process behind, and the head's Redis user needs no scripting, and (6) restarts its loop with backoff when
it ends on an error (Redis lost, a forged key of the wrong type) rather than on a stop request.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import redis
from rq import Queue, SimpleWorker
from rq.defaults import DEFAULT_LOGGING_DATE_FORMAT, DEFAULT_LOGGING_FORMAT
from rq.exceptions import StopRequested
from rq.job import Job
from rq.serializers import JSONSerializer
from rq.timeouts import TimerDeathPenalty
from rq.utils import now

from relay_broker.retry import ride_out
from relay_broker.rq_jobs import SafeJob
from schemas.jobs import RUN_GENERATION, ModelInfo
from schemas.keys import Keys
from schemas.settings import Settings
from workers.head.jobs import job_function as jobs
from workers.head.jobs.dispatcher import Dispatcher
from workers.head.jobs.scheduler import ThreadScheduler
from workers.head.runtime import HeadRuntime

log = logging.getLogger("shardflow.head_worker")


class _LoopEnded(Exception):
    """RQ's loop ended on an error, not on a stop request: restart it."""


def head_job_class(ctx: jobs.JobContext, fallback_ttl_s: int | None = None) -> type[SafeJob]:
    """This worker's job class: the one job function, bound to its models, looked up by its wire name (never
    imported by it; see relay_broker/rq_jobs.py)."""
    functions: Mapping[str, Callable[..., Any]] = {RUN_GENERATION: functools.partial(jobs.run_generation, ctx)}
    fallback = SafeJob.fallback_ttl_s if fallback_ttl_s is None else fallback_ttl_s  # a record's TTL if it has none
    return type("HeadJob", (SafeJob,), {"functions": functions, "fallback_ttl_s": fallback})


class HeadWorker(SimpleWorker):
    """Runs generation jobs with models loaded once, heartbeating while each runs."""

    death_penalty_class = TimerDeathPenalty  # job timeouts by timer, not SIGALRM: works in worker threads
    _restarted = False  # set once RQ's loop has been restarted after an error (see register_birth)
    _quick_ends = 0  # RQ's loop ended this many times in a row, each soon after it started

    def __init__(
        self,
        queues: list[str],
        runtime: HeadRuntime | None,
        r: redis.Redis,
        *,
        names: Keys | None = None,
        model_info: ModelInfo | None = None,
        capacity: int | None = None,
        **kwargs: Any,
    ) -> None:
        """`capacity`: jobs in flight at once (default: `HeadRuntime.capacity`, the batch slots and `jobs.ahead`)."""
        self.names = names or Keys()
        # the runtime's settings (RQ's Worker has a `settings`-free namespace of its own, hence the name)
        self.shardflow_settings = cfg = runtime.settings if runtime is not None else Settings()
        self.job_context = jobs.JobContext(runtime, r, self.names)
        job_class = head_job_class(self.job_context, cfg.jobs.result_ttl_s)
        kwargs.setdefault("serializer", JSONSerializer)
        kwargs.setdefault("job_class", job_class)
        kwargs.setdefault("maintenance_interval", cfg.jobs.maintenance_s)
        kwargs.setdefault("worker_ttl", max(cfg.jobs.heartbeat_ttl_s * 2, 16))
        kwargs.setdefault("job_monitoring_interval", max(int(cfg.jobs.heartbeat_s), 1))
        super().__init__(
            [Queue(q, connection=r, serializer=JSONSerializer, job_class=job_class) for q in queues],
            connection=r,
            **kwargs,
        )
        if runtime is not None:  # tails know this head by its worker name (workers/head/beacon.py)
            runtime.beacons.rename(self.name)
        if model_info is not None:
            for q in queues:
                r.set(self.names.model_info(q), model_info.model_dump_json())
        default = runtime.capacity if runtime is not None else 1
        self.dispatcher = Dispatcher(self, capacity or default)

    def work(
        self, burst: bool = False, logging_level: str | None = "INFO", with_scheduler: bool = False, **_: Any
    ) -> bool:
        """RQ's loop, restarted with backoff (relay_broker.retry) when it ends on an error (Redis lost
        mid-job, say) rather than on a stop request: RQ retries a lost connection only while it waits for
        jobs. The wait doubles from 1 s up to worker_restart_max_s, and starts over after a loop that ran
        well for worker_restart_reset_s."""
        try:
            return ride_out(
                lambda: self._work_once(burst, logging_level, with_scheduler),
                errors=(_LoopEnded,),
                wait=lambda _: min(
                    2.0 ** max(self._quick_ends - 1, 0), self.shardflow_settings.jobs.worker_restart_max_s
                ),
                on_retry=lambda e, s: log.warning("worker %s: %s; restarting in %.0fs", self.name, e, s),
            )
        except StopRequested:  # a stop signal while waiting
            return False

    def _work_once(self, burst: bool = False, logging_level: str | None = "INFO", with_scheduler: bool = False) -> bool:
        """One run of the job loop (workers/head/jobs/dispatcher.py): its result if it finished or was stopped,
        else _LoopEnded."""
        started = time.monotonic()
        try:
            worked = self._serve(burst, logging_level, with_scheduler)
        except StopRequested:
            return False
        except (redis.ConnectionError, redis.TimeoutError) as e:
            log.warning("worker %s: Redis lost (%s)", self.name, e)
            worked = False
        except Exception as e:  # a forged key of the wrong type, say: never the end of the worker
            log.error("worker %s: its loop ended on %r", self.name, e)
            worked = False
        if burst or self._stop_requested or self._shutdown_requested_date is not None:
            return worked  # finished, or stopped on request (an idle worker's stop sets only the date)
        ran_well = time.monotonic() - started > self.shardflow_settings.jobs.worker_restart_reset_s
        self._quick_ends = 1 if ran_well else self._quick_ends + 1
        self._restarted = True
        raise _LoopEnded("its loop ended on an error")

    def register_birth(self) -> None:
        """RQ refuses to start a worker whose name a live record holds. After a restart of the loop that
        record is this worker's own, left alive by a Redis restored from disk (the lost loop could not
        record its end): end it first, in the same step, so Redis coming back in between cannot matter.
        A first start keeps RQ's check: two workers never share a name."""
        if self._restarted:
            self._end_own_record()
        super().register_birth()

    def _end_own_record(self) -> None:
        """Record this worker's end (if Redis is still gone, the restart fails and the loop waits again)."""
        try:
            self.register_death()
        except redis.RedisError as e:
            log.debug("worker %s: could not end its old record yet: %s", self.name, e)

    def run_maintenance_tasks(self) -> None:
        """RQ's maintenance; an error there (a registry key of the wrong type, say) is logged, not the end of
        the loop, and the queues' maintenance locks are released so the next round tries again."""
        try:
            super().run_maintenance_tasks()
        except (redis.ConnectionError, redis.TimeoutError, StopRequested):
            raise
        except Exception as e:
            log.error("worker %s: maintenance failed: %r", self.name, e)
            self.last_cleaned_at = now()
            for queue in self.queues:
                try:
                    queue.release_maintenance_lock()
                except redis.RedisError:
                    pass

    def _start_scheduler(
        self,
        burst: bool = False,
        logging_level: str | None = "INFO",
        date_format: str = DEFAULT_LOGGING_DATE_FORMAT,
        log_format: str = DEFAULT_LOGGING_FORMAT,
    ) -> None:
        """RQ's `_start_scheduler` with `ThreadScheduler`: the scheduler is a thread of this process (RQ
        forks a child that a SIGKILL of the head would leave running), and keeps its locks without Lua."""
        self.scheduler = ThreadScheduler(
            self.queues,
            connection=self.connection,
            logging_level=logging_level if logging_level is not None else self.log.level,
            date_format=date_format,
            log_format=log_format,
            serializer=self.serializer,
            settings=self.shardflow_settings,
        )
        self.scheduler.acquire_locks()
        if not self.scheduler.acquired_locks:
            return  # another head schedules this queue; maintenance takes over if its lock expires
        if burst:
            try:
                self.scheduler.register_birth()
                self.scheduler.enqueue_scheduled_jobs()
            finally:
                self.scheduler.release_locks()
                self.scheduler.register_death()
        else:
            self.scheduler.start()

    def stop_scheduler(self) -> None:
        """Stop the scheduler thread (it releases its locks) and wait for it briefly."""
        if isinstance(self.scheduler, ThreadScheduler):
            self.scheduler.join(5.0)

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is threading.main_thread():  # workers in extra threads get none
            super()._install_signal_handlers()

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        """A short TTL: a running job whose worker stops heartbeating is abandoned within seconds."""
        return self.shardflow_settings.jobs.heartbeat_ttl_s

    def _serve(self, burst: bool, logging_level: str | None, with_scheduler: bool) -> bool:
        """RQ's `work` with its one-job loop replaced by the dispatcher's: start up as RQ does (record,
        pubsub for RQ's commands, scheduler thread, signal handlers), serve, tear down."""
        self.bootstrap(logging_level, DEFAULT_LOGGING_DATE_FORMAT, DEFAULT_LOGGING_FORMAT)
        try:
            if with_scheduler:
                self._start_scheduler(burst, logging_level)
            self._install_signal_handlers()
            return self.dispatcher.serve(burst)
        finally:
            self.teardown()
