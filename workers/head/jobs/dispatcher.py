"""A head worker's job loop: many generation jobs in flight in one RQ worker, a few Redis round trips each.

RQ's own loop runs one job at a time and spends ~25 sequential round trips per job on bookkeeping (heartbeats, state,
registries, maintenance) between dequeues, which over a WAN link costs seconds per job. `Dispatcher` keeps RQ's
records and semantics (started/finished/failed registries, executions, retries through RQ's scheduler, abandoned-job
cleanup by heartbeat expiry) and changes how they are written; the writes themselves, RQ's bookkeeping, are
`RQRecords`'s (workers/head/jobs/rq_records.py), called from this loop:

- **dequeue**: as many jobs as there are free slots, `LMOVE`d to the queue's intermediate list in one pipelined round
  trip (when the queue was empty, `BLMOVE` with a short timeout, pipelined with the `LMOVE`s that take the rest of a
  batch enqueued at once);
- **fetch + start**: one pipeline reads the records, one transaction starts them all (`RQRecords.start`: execution
  records, started registry, status, the worker's state), sent while the jobs begin to compute (a job records its end
  only after that transaction);
- **run**: each job's generation goes to the head's step loop (workers/head/loop.py: one thread steps every
  generation in flight); no thread per job: its start (`start_generation`) runs on this loop's thread, its end
  (`end_generation`: the result stored, then RQ's records) on one of a fixed few `finisher` threads once the step
  loop has resolved it;
- **finish**: one transaction for the jobs that ended together (`RQRecords.finished`: result, finished registry,
  execution cleanup, worker counters); a failure goes through RQ's `handle_job_failure` (`RQRecords.failed`: retries,
  failed registry); a job its user cancelled (JobCancelled, workers/head/jobs/job_function.py) ends `canceled`
  (`RQRecords.canceled`: status, canceled registry), as RQ's own cancel leaves a queued job: never failed, never
  retried by RQ (`shardflow retry` resumes it);
- **housekeeping** on a thread of its own, never between a free slot and the next dequeue: one pipelined heartbeat of
  the worker and every running job each `heartbeat_s` (`RQRecords.heartbeat`, which also asks whether a job still
  waiting for a cache slot was cancelled), RQ's maintenance each `maintenance_s` (`RQRecords.maintain`).

Capacity (jobs in flight) is the head's `--concurrency`, by default what its batch slots hold and `jobs.ahead` more (a
sixteenth), which wait on the step loop for the next slot freed.
"""

from __future__ import annotations

import logging
import queue as queues
import threading
from dataclasses import dataclass, field

import redis
from rq.exceptions import NoSuchJobError
from rq.executions import Execution
from rq.job import Job
from rq.queue import Queue
from rq.utils import now
from rq.worker import SimpleWorker

from schemas.requests import GenerationResult
from workers.drain import take_queued
from workers.head.jobs.job_function import (
    JobCancelled,
    Started,
    end_generation,
    finish_many,
    run_generation,
    settle,
    start_generation,
)
from workers.head.jobs.rq_records import ExcInfo, RQRecords, exc_info

log = logging.getLogger("shardflow.dispatcher")
FINISHERS = 2  # threads that store results and record ends (each end batch: two Redis round trips for all of it)


@dataclass
class Running:
    job: Job
    queue: Queue
    execution: Execution
    recorded: threading.Event = field(default_factory=threading.Event)  # its start transaction has run
    started: Started | None = None  # its generation on the step loop, once begun
    ended: bool = False  # its generation is over (its end is being recorded): its room is the next job's


class Dispatcher:
    """Dequeues, starts, runs and finishes up to `capacity` jobs at once for one HeadWorker."""

    def __init__(self, worker: SimpleWorker, capacity: int) -> None:
        """`worker`: the HeadWorker (workers/head/jobs/rq_worker.py) whose records, settings (`shardflow_settings`),
        key names (`names`) and job context (`job_context`) the jobs run under."""
        self.w, self.capacity = worker, max(capacity, 1)
        self.records = RQRecords(worker)
        self.running: dict[str, Running] = {}
        self.recording = 0  # of `running`, those whose generation ended: their room is free (`_wait_for_room`)
        self.cond = threading.Condition()
        self.completed = 0
        # jobs whose generation ended: each with its generation (None if it never began) and what failed it, if known
        self._ends: queues.Queue[tuple[Running, Started | None, ExcInfo | None]] = queues.Queue()
        for i in range(FINISHERS):  # each takes every end queued: results and RQ's records a round trip for all
            threading.Thread(target=self._finisher, daemon=True, name=f"finisher_{i}").start()

    # --- the loop -------------------------------------------------------------------------------------
    def serve(self, burst: bool) -> bool:
        """Run jobs until the worker is asked to stop (then let those in flight finish) or, in burst mode,
        until the queues are empty and nothing runs; True if any job ran. Redis errors of the dequeue path
        propagate (the worker restarts its loop; jobs in flight go on)."""
        done = threading.Event()
        keeper = threading.Thread(target=self._housekeep, args=(done,), daemon=True, name="housekeeping")
        keeper.start()
        try:
            while not self.w._stop_requested:
                free = self._wait_for_room()
                if free == 0:
                    continue
                taken = self._dequeue(free, block=not burst)
                if taken:
                    self._start(taken)
                elif burst:
                    if not self.running:
                        break
                    with self.cond:
                        self.cond.wait(0.05)
            self.drain()  # a warm stop, or burst's end: jobs in flight finish (still heartbeating)
        finally:
            done.set()
            keeper.join(5.0)
        return self.completed > 0

    def drain(self, timeout: float | None = None) -> None:
        """Wait for the jobs in flight to finish."""
        with self.cond:
            self.cond.wait_for(lambda: not self.running, timeout)

    def _wait_for_room(self) -> int:
        """Free room: capacity less the jobs whose generation still runs. A job whose generation ended makes room at
        once, while its result and RQ's records are written (two round trips: waiting for them left its cache slot
        empty for three on a WAN, the next job's dequeue included)."""
        with self.cond:
            self.cond.wait_for(lambda: self._generating() < self.capacity or self.w._stop_requested, 1.0)
            return 0 if self.w._stop_requested else self.capacity - self._generating()

    def _generating(self) -> int:  # under `cond`: the jobs whose generation has not ended
        return len(self.running) - self.recording

    # --- dequeue, fetch, start --------------------------------------------------------------------------
    def _dequeue(self, n: int, block: bool) -> list[tuple[str, Queue]]:
        """Up to n job ids moved to their queue's intermediate list (RQ's safety net while they start)."""
        r = self.w.connection
        got: list[tuple[str, Queue]] = []
        for queue in self.w.queues:
            pipe = r.pipeline(transaction=False)
            for _ in range(n - len(got)):
                pipe.lmove(queue.key, queue.intermediate_queue_key, "LEFT", "RIGHT")
            got += [(_text(x), queue) for x in pipe.execute() if x]
            if len(got) >= n:
                return got
        if got or not block:
            return got
        # the queue was empty: block for a job, and take the rest of its batch in the same round trip (an
        # enqueue of many jobs is one transaction, so they are all there when the first wakes us)
        queue = self.w.queues[0]
        timeout = max(int(self.w.shardflow_settings.redis.block_ms // 1000), 1)
        pipe = r.pipeline(transaction=False)
        pipe.blmove(queue.key, queue.intermediate_queue_key, timeout, "LEFT", "RIGHT")
        for _ in range(n - 1):
            pipe.lmove(queue.key, queue.intermediate_queue_key, "LEFT", "RIGHT")
        return [(_text(x), queue) for x in pipe.execute() if x]

    def _fetch(self, taken: list[tuple[str, Queue]]) -> tuple[list[tuple[Job, Queue]], list[tuple[str, Queue]]]:
        """Read the records of the jobs taken, with the stored result and checkpoint their function reads (kept in
        the job context), in one round trip: the jobs, and the ids whose record is gone (or never was a job)."""
        w, r = self.w, self.w.connection
        pipe = r.pipeline(transaction=False)
        for jid, _ in taken:  # each job's record, and the stored result and checkpoint its function reads
            pipe.hgetall(w.job_class.key_for(jid))
            pipe.get(w.names.result(jid))
            pipe.get(w.names.checkpoint(jid))
        # anyone able to write RQ's keys may have put something else there: a key of another type is no job
        got = [None if isinstance(x, redis.ResponseError) else x for x in pipe.execute(raise_on_error=False)]
        jobs: list[tuple[Job, Queue]] = []
        gone: list[tuple[str, Queue]] = []
        for i, (jid, queue) in enumerate(taken):
            raw, w.job_context.prefetched[jid] = got[3 * i], (got[3 * i + 1], got[3 * i + 2])
            job = w.job_class(jid, connection=r, serializer=w.serializer)
            try:
                if not raw:
                    raise NoSuchJobError(jid)
                job.restore(raw)
            except NoSuchJobError:  # deleted (or never a job): nothing to run
                w.job_context.prefetched.pop(jid, None)
                gone.append((jid, queue))
                continue
            jobs.append((job, queue))
        return jobs, gone

    def _start(self, taken: list[tuple[str, Queue]]) -> None:
        """Read the records (one round trip), start them all (one transaction), hand each to the step loop."""
        jobs, gone = self._fetch(taken)
        tx, executions = self.records.start(jobs, gone)  # queued, sent below
        with tx:
            started = [Running(job, queue, ex) for (job, queue), ex in zip(jobs, executions, strict=True)]
            with self.cond:
                for run in started:
                    self.w.executions[run.execution.id] = run.execution
                    self.running[run.job.id] = run
            # the jobs start computing while their start transaction travels (their first round needs a round
            # trip of its own anyway); each records how it ended only after that transaction has run
            for run in started:
                with self.cond:
                    generating = self._generating()
                log.info("job %s started (%d generating, %d in flight)", run.job.id, generating, len(self.running))
                self._begin(run)
            try:
                tx.execute()
            finally:
                for run in started:
                    run.recorded.set()

    # --- run, finish ------------------------------------------------------------------------------------
    def _begin(self, run: Running) -> None:
        """Hand the job's generation to the step loop (its function must be the allow-listed run_generation);
        its end runs on a finisher thread once the loop resolves it."""
        job = run.job
        try:
            fn = job.func  # SafeJob's allow-list: anything else raises
            if getattr(fn, "func", None) is not run_generation:
                raise TypeError(f"job function {job.func_name!r} is not a generation")
            timeout = job.timeout or run.queue.DEFAULT_TIMEOUT
            started = start_generation(self.w.job_context, job, *job.args, timeout_s=timeout, **job.kwargs)
        except BaseException as e:
            self._ended(run, None, exc_info(e))
            return
        run.started = started
        if started.future is None:
            self._ended(run, started, None)
        else:
            started.future.add_done_callback(lambda _: self._ended(run, started, None))

    def _ended(self, run: Running, started: Started | None, failed: ExcInfo | None) -> None:
        """The job's generation is over: its room goes to the next job now; its end is recorded on a finisher."""
        with self.cond:
            if not run.ended:
                run.ended = True
                self.recording += 1
                self.cond.notify_all()
        self._ends.put((run, started, failed))

    def _finisher(self) -> None:
        while True:
            batch = take_queued(self._ends)
            try:
                self._end_many(batch)
            except BaseException:  # a bug: logged; each job's heartbeat expiry retries what was not recorded
                log.exception("recording the ends of %d jobs failed", len(batch))

    def _end_many(self, batch: list[tuple[Running, Started | None, ExcInfo | None]]) -> None:
        """Record how these jobs ended. Generations that succeeded are finished together: their results and
        final text in one round trip (the flush pool's), RQ's records in one transaction; anything else (a
        stored result, a failure, a cancel) one job at a time, as `_end`."""
        ended: list[tuple[Running, Started, GenerationResult]] = []
        for run, started, failed in batch:
            if failed is not None or started is None or started.stored is not None:
                self._end(run, started, failed)
                continue
            try:
                ended.append((run, started, settle(started)))
            except BaseException as e:
                self._end(run, started, exc_info(e))
        if not ended:
            return
        ctx = self.w.job_context
        values = finish_many(ctx, [(s.job, s.progress, result, s.ttl) for _, s, result in ended])  # type: ignore[misc]
        done: list[tuple[Running, dict]] = []
        for (run, started, _), value in zip(ended, values, strict=True):
            if isinstance(value, BaseException):
                self._end(run, started, exc_info(value))
                continue
            run.job._result, run.job.ended_at = value, now()
            done.append((run, value))
        try:
            for run, _ in done:
                run.recorded.wait()
            self._finished(done)
        except BaseException:  # could not be recorded: heartbeat expiry retries them (their results are stored)
            log.exception("could not record the ends of %d jobs", len(done))
        finally:
            for run, _ in done:
                self._forget(run)

    def _end(self, run: Running, started: Started | None, failed: ExcInfo | None) -> None:
        """Record how the job ended: finished (its result stored), canceled, or failed (RQ's retries)."""
        job = run.job
        try:
            try:
                if failed is not None:
                    raise failed[1].with_traceback(failed[2])
                assert started is not None
                value = end_generation(self.w.job_context, started)
                job._result = value
                job.ended_at = now()
                run.recorded.wait()
                self._finished([(run, value)])
            except BaseException as e:
                job.ended_at = job.ended_at or now()
                run.recorded.wait()
                if isinstance(e, JobCancelled):
                    self.records.canceled(job, run.execution, idle=len(self.running) <= 1)
                    log.info("job %s cancelled by its user", job.id)
                else:
                    self.records.failed(job, run.queue, run.execution, exc_info(e))
        except BaseException:  # the failure could not be recorded either: heartbeat expiry retries it
            log.exception("job %s: could not record how it ended", job.id)
        finally:
            self._forget(run)

    def _finished(self, done: list[tuple[Running, dict]]) -> None:
        """RQ's success records of these jobs (each with its result) in one transaction (`RQRecords.finished`),
        the worker marked idle in it when they were the last in flight."""
        if not done:
            return
        idle = len(self.running) <= len(done)
        self.records.finished([(run.job, run.execution, value) for run, value in done], idle)
        for run, _ in done:
            job = run.job
            log.info("job %s finished in %.2fs", job.id, (job.ended_at - job.started_at).total_seconds())  # type: ignore[operator]

    def _forget(self, run: Running) -> None:
        """The job is over for this worker: out of its running set (room for the next)."""
        w = self.w
        w.job_context.prefetched.pop(run.job.id, None)  # a job whose function never ran leaves it behind
        with self.cond:
            if self.running.pop(run.job.id, None) is not None and run.ended:
                self.recording -= 1
            w.executions.pop(run.execution.id, None)
            self.completed += 1
            self.cond.notify_all()

    # --- housekeeping -----------------------------------------------------------------------------------
    def _housekeep(self, stop: threading.Event) -> None:
        """Heartbeats of the worker and its running jobs every heartbeat_s; RQ's maintenance when due.
        Errors are logged and tried again next period (a job whose beats stop is retried elsewhere)."""
        cfg = self.w.shardflow_settings
        while not stop.wait(cfg.jobs.heartbeat_s):
            try:
                self.beat()
                self.records.maintain()
            except (redis.RedisError, OSError) as e:
                log.warning("worker %s: housekeeping failed: %s", self.w.name, e)

    def beat(self) -> None:
        """One pipelined heartbeat: the worker's record and each running job and execution; with it, whether the user
        of a job whose generation waits for a cache slot (no verdict yet, so no progress flush asks) cancelled it."""
        w = self.w
        with self.cond:
            runs = list(self.running.values())
        unseated = [s for r in runs if (s := r.started) and s.future and not (s.progress and s.progress.rounds)]
        asks = [w.names.cancel(started.job.id) for started in unseated]
        cancelled = self.records.heartbeat([(run.job, run.execution) for run in runs], asks)
        for started in (s for s, yes in zip(unseated, cancelled, strict=True) if yes):
            loop = w.job_context.runtime.loop_for(w.job_context.r)
            loop.cancel(started.future, JobCancelled("cancelled by its user while waiting for a cache slot"))


def _text(x: bytes | str) -> str:
    return x.decode(errors="replace") if isinstance(x, bytes) else x
