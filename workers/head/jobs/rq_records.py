"""RQ's records of a head worker's jobs, written in a few round trips: the dispatcher's bookkeeping.

RQ's own worker writes a job's records one command, or one small pipeline, at a time (~25 sequential round trips a
job). `RQRecords` writes the same records, with RQ's own calls and so RQ's own semantics, gathered into as few round
trips as the job loop (workers/head/jobs/dispatcher.py) allows:

- **start** (one transaction for every job dequeued together): each job's execution record (its execution registry,
  the started registry, the worker's execution index), its heartbeat, `started` status, worker name and start time,
  its record made persistent and its id taken off the queue's intermediate list; the ids of jobs whose record was
  gone taken off it too; the worker's heartbeat and, if any job starts, its `busy` state. The transaction is handed
  back unsent, so that the jobs begin computing while it travels;
- **finish** (one transaction for every job that ended together): each job's result record and `finished` status,
  the finished registry, its record's expiry (the result TTL), its execution cleaned up (out of the started registry,
  its execution record deleted), the worker's success count and working time; the worker's `idle` state when none
  is left running. Jobs here never have dependents, so none are enqueued;
- **cancel** (one transaction): a job its user cancelled ends `canceled` (status, end time and retries left saved,
  the canceled registry), its execution cleaned up and its record kept as long as a failure's (`failure_ttl`), the
  worker's working time (never its failure count); the worker's `idle` state when none is left running. As RQ's own
  cancel leaves a queued job: never failed, never retried by RQ (`shardflow retry` resumes it);
- **fail** (RQ's own `handle_exception` and `handle_job_failure`: one transaction, then RQ's follow-ups, its
  dependents and its rate-limit slot): a retry scheduled (RQ's scheduler enqueues it when its backoff is due), or
  `failed` with the failed registry and the exception's text; the execution cleaned up; the worker's failure count
  and working time;
- **heartbeat** (one pipelined round trip, no transaction): the worker's record and each running job's heartbeat
  and execution (its execution record, the started registry, its execution registry), so that a job whose worker
  dies is abandoned within `heartbeat_ttl_s` and retried elsewhere; the loop's own questions (whether a key exists)
  ride along;
- **maintenance**: RQ's own, when it is due (registries cleaned: abandoned jobs retried or failed, leftovers of the
  intermediate lists handled, dead workers unregistered; the scheduler's locks taken if no scheduler holds them).

What is not RQ's (the dequeue, the job records read with the job function's result and checkpoint, the threads, the
logs) stays in the job loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType

from redis.client import Pipeline
from rq.defaults import DEFAULT_FAILURE_TTL
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.job_lifecycle import format_exc_info
from rq.queue import Queue
from rq.registry import CanceledJobRegistry
from rq.utils import now
from rq.worker import SimpleWorker
from rq.worker.base import WorkerStatus

ExcInfo = tuple[type[BaseException], BaseException, TracebackType | None]
"""An exception as RQ's failure handling takes it: what `sys.exc_info()` returns while it is handled."""


def exc_info(e: BaseException) -> ExcInfo:
    """`e` as RQ's failure handling takes it (while `e` is handled, the same as `sys.exc_info()`)."""
    return type(e), e, e.__traceback__


class RQRecords:
    """The RQ records of one worker's jobs: started, finished, canceled, failed, heartbeats, maintenance."""

    def __init__(self, worker: SimpleWorker) -> None:
        """`worker`: the RQ worker whose records (name, state, counters, execution index) and settings (heartbeat
        TTL, result TTL, exception handlers) the jobs' records are written with."""
        self.w = worker

    def start(
        self, jobs: Sequence[tuple[Job, Queue]], gone: Sequence[tuple[str, Queue]]
    ) -> tuple[Pipeline, list[Execution]]:
        """Queue the start of `jobs` (each with the queue it came from) in one transaction, and take the ids of
        `gone` (jobs whose record was missing) off their queue's intermediate list in it; return the transaction,
        not yet sent, with each job's `Execution`, in the order of `jobs`. The caller sends it (`execute`) and
        resets it (`with tx:`): its jobs may begin computing meanwhile, but must record no end before it has run."""
        w = self.w
        tx = w.connection.pipeline()
        try:
            w.heartbeat(pipeline=tx)
            executions: list[Execution] = []
            for job, queue in jobs:
                ttl = w.get_heartbeat_ttl(job)
                executions.append(Execution.create(job, ttl, pipeline=tx, worker_name=w.name))
                job.heartbeat(now(), ttl, pipeline=tx)
                job.prepare_for_execution(w.name, pipeline=tx)
                tx.persist(job.key)
                tx.lrem(queue.intermediate_queue_key, 1, job.id)
            for jid, queue in gone:
                tx.lrem(queue.intermediate_queue_key, 1, jid)
            if jobs:
                w.set_state(WorkerStatus.BUSY, pipeline=tx)
        except BaseException:
            tx.reset()
            raise
        return tx, executions

    def finished(self, ends: Sequence[tuple[Job, Execution, dict]], idle: bool) -> None:
        """RQ's success records of these jobs (each with its execution and its result, its `ended_at` set), as one
        transaction; with them the worker's `idle` state if `idle` (no other job left running). Jobs here never
        have dependents."""
        if not ends:
            return
        w = self.w
        with w.connection.pipeline() as tx:
            for job, ex, value in ends:
                job._result, job._status = value, JobStatus.FINISHED
                ttl = job.get_result_ttl(w.default_result_ttl)
                w.increment_successful_job_count(pipeline=tx)
                w.increment_total_working_time(job.ended_at - job.started_at, tx)  # type: ignore[operator]
                job._handle_success(
                    ttl,
                    pipeline=tx,
                    worker_name=w.name,
                    execution_id=ex.id,
                    execution_started_at=ex.created_at,
                    execution_ended_at=job.ended_at,
                )
                job.cleanup(ttl, pipeline=tx, remove_from_queue=False)
                w.cleanup_execution(job, pipeline=tx, execution=ex)
            if idle:
                w.set_state(WorkerStatus.IDLE, pipeline=tx)
            tx.execute()

    def canceled(self, job: Job, ex: Execution, idle: bool) -> None:
        """A job its user cancelled (its `ended_at` set), as one transaction: `canceled` (status, canceled registry)
        with its execution cleaned up and its record kept as long as a failure's (failure_ttl), never failed; with
        it the worker's `idle` state if `idle` (no other job left running)."""
        w = self.w
        job._status = JobStatus.CANCELED
        ttl = job.failure_ttl if job.failure_ttl is not None else DEFAULT_FAILURE_TTL
        canceled = CanceledJobRegistry(job.origin, w.connection, job_class=w.job_class, serializer=w.serializer)
        with w.connection.pipeline() as tx:
            job.save(pipeline=tx, include_meta=False, include_result=False)  # status, ended_at, retries_left
            canceled.add(job, ttl=ttl, pipeline=tx)
            job.cleanup(ttl, pipeline=tx, remove_from_queue=False)
            w.cleanup_execution(job, pipeline=tx, execution=ex)
            w.increment_total_working_time(job.ended_at - job.started_at, tx)  # type: ignore[operator]
            if idle:
                w.set_state(WorkerStatus.IDLE, pipeline=tx)
            tx.execute()

    def failed(self, job: Job, queue: Queue, ex: Execution, failure: ExcInfo) -> None:
        """A job that failed (its `ended_at` set), through RQ: its exception handlers (`handle_exception`: logged),
        then `handle_job_failure` (one transaction: a retry if it has retries left, else `failed` in the failed
        registry; its execution cleaned up; the worker's counters; then its dependents and rate-limit slot)."""
        w = self.w
        job._status = JobStatus.FAILED
        w.handle_exception(job, *failure)

        w.handle_job_failure(
            job=job,
            queue=queue,
            started_job_registry=queue.started_job_registry,
            exc_string=format_exc_info(failure),
            execution=ex,
        )

    def heartbeat(self, running: Sequence[tuple[Job, Execution]], asks: Sequence[str] = ()) -> list[bool]:
        """One pipelined round trip (no transaction): the worker's record (alive for `job_monitoring_interval` + 60
        s) and each running job's heartbeat and execution (for the worker's heartbeat TTL); with them, whether each
        key of `asks` exists, returned in their order."""
        w = self.w
        ttl = w.get_heartbeat_ttl(running[0][0]) if running else 0
        with w.connection.pipeline(transaction=False) as pipe:
            w.heartbeat(w.job_monitoring_interval + 60, pipeline=pipe)
            for job, ex in running:
                ex.heartbeat(job.started_job_registry, ttl, pipeline=pipe)
                job.heartbeat(now(), ttl, pipeline=pipe, xx=True)
            for key in asks:
                pipe.exists(key)
            replies = pipe.execute()
        return [bool(x) for x in replies[len(replies) - len(asks) :]]

    def maintain(self) -> None:
        """RQ's maintenance if it is due (`maintenance_s` after the last): its registries cleaned (a job whose
        heartbeats stopped is retried or failed), the scheduler's locks taken if no scheduler holds them."""
        if self.w.should_run_maintenance_tasks:
            self.w.run_maintenance_tasks()
