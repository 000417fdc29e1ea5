"""Process hygiene of the head worker: its RQ scheduler is a thread, not a forked child, so a SIGKILL
(or an out-of-memory kill) of the head leaves no process of it running; the scheduler's locks are kept
without Lua (SET NX EX, WATCH/MULTI/EXEC), and it still enqueues scheduled jobs (retries) when due."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import redis
from rq import Queue
from rq.job import Job
from rq.registry import ScheduledJobRegistry
from rq.scheduler import RQScheduler
from rq.serializers import JSONSerializer

from relay_broker.connection import connect
from schemas.jobs import RUN_GENERATION
from schemas.settings import Settings
from workers.head.jobs.scheduler import ThreadScheduler

SPLIT = 2


# --- /proc ------------------------------------------------------------------------------------------
def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time) of a process, None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text.rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid ... starttime is field 22
    return fields[0], int(fields[1]), int(fields[19])


def _descendants(root: int) -> dict[int, int]:
    """Every live descendant of `root` (children, recursively): pid -> start time (tells pid reuse apart)."""
    parents: dict[int, tuple[int, int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None and st[0] != "Z":
            parents[int(entry)] = (st[1], st[2])
    found: dict[int, int] = {}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, start) in parents.items():
            if ppid == parent and pid not in found:
                found[pid] = start
                frontier.append(pid)
    return found


def _alive(pid: int, start: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] != "Z" and st[2] == start


# --- a SIGKILLed head leaves nothing behind ----------------------------------------------------------
@pytest.mark.slow
def test_sigkilled_head_leaves_no_process_and_its_scheduler_lock_expires(models, redis_server, tmp_path):
    r = connect(redis_server.url)
    queue, prefix, ttl = "q-procs", "p-procs", 3
    env = {**os.environ, "SHARDFLOW_JOBS__HEARTBEAT_TTL_S": str(ttl), "SHARDFLOW_JOBS__MAINTENANCE_S": "1"}
    args = ["head", "--target", str(models["qwen2"].target), "--layers", f"0:{SPLIT}", "--queue", queue]
    args += ["--prefix", prefix, "--redis-url", redis_server.url, "--threads", "1", "--name", "procs-h1"]
    log = tmp_path / "head.log"
    head = subprocess.Popen(
        [sys.executable, "-m", "producer", *args], stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env
    )
    try:
        lock = RQScheduler.get_locking_key(queue)
        deadline = time.monotonic() + 90
        owner = None
        while not (r.scard(f"rq:workers:{queue}") and owner and r.hexists(f"rq:scheduler:{owner}", "pid")):
            assert head.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "head worker did not start its scheduler"
            time.sleep(0.2)
            owner = (r.get(lock) or b"").decode()  # the lock is taken just before the thread records itself
        scheduler = r.hgetall(f"rq:scheduler:{owner}")
        assert int(scheduler[b"pid"]) == head.pid  # the scheduler runs inside the head process
        time.sleep(1.5)  # a few scheduler and maintenance cycles: anything it would fork exists by now
        family = _descendants(head.pid)
        assert family == {}, f"the head has child processes: {family}"
        family[head.pid] = _stat(head.pid)[2]  # type: ignore[index]
        head.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        head.wait(10)
        while time.monotonic() < killed + 5 and any(_alive(p, s) for p, s in family.items()):
            time.sleep(0.1)
        assert not [p for p, s in family.items() if _alive(p, s)], "a process of the killed head survived"
        while r.exists(lock) and time.monotonic() < killed + ttl + 3:
            time.sleep(0.1)
        assert not r.exists(lock), "the killed head's scheduler lock outlived its TTL"
    finally:
        if head.poll() is None:
            head.kill()
            head.wait()


# --- the scheduler thread, in process ---------------------------------------------------------------
def _job_due_now(r, queue: Queue) -> Job:
    job = queue.enqueue_in(timedelta(seconds=0), RUN_GENERATION, {"prompt": "x"})
    # scheduled, or already moved to its queue by a scheduler thread running every 0.2 s (a race on a busy machine)
    assert job.id in ScheduledJobRegistry(queue=queue).get_job_ids() or job.id in queue.get_job_ids()
    return job


@pytest.fixture
def no_lua(monkeypatch):
    """Any Lua script (EVAL, EVALSHA, SCRIPT LOAD through redis-py) fails the test."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a script was run")

    for method in ("eval", "evalsha", "eval_ro", "evalsha_ro", "fcall", "register_script", "script_load"):
        monkeypatch.setattr(redis.Redis, method, refuse)


def test_thread_scheduler_enqueues_due_jobs_and_keeps_its_lock_without_lua(redis_server, no_lua):
    r = connect(redis_server.url)
    queue = Queue("q-sched", connection=r, serializer=JSONSerializer)
    lock = ThreadScheduler.get_locking_key(queue.name)
    r.delete(lock)
    ours = ThreadScheduler([queue.name], connection=r, serializer=JSONSerializer, interval=0.2)
    other = ThreadScheduler([queue.name], connection=r, serializer=JSONSerializer)
    assert ours.acquire_locks(auto_start=True) == {queue.name}
    try:
        assert ours._process is not None and ours._process.is_alive() and ours._process.daemon
        assert other.acquire_locks() == set()  # one scheduler per queue
        assert 0 < r.ttl(lock) <= ours.lock_ttl and r.get(lock).decode() == ours.name
        other._acquired_locks = {queue.name}
        other.release_locks()  # never deletes a lock it does not hold
        assert r.get(lock).decode() == ours.name
        job = _job_due_now(r, queue)
        deadline = time.monotonic() + 10
        while job.id not in queue.get_job_ids() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert job.id in queue.get_job_ids(), "the scheduler thread did not enqueue a due job"
        assert isinstance(ours._process, threading.Thread)  # nothing was forked for it
    finally:
        ours.join(5)
    assert not ours._process.is_alive()
    assert not r.exists(lock)  # released on stop
    assert other.acquire_locks() == {queue.name}  # free for the next one
    other.release_locks()


@pytest.mark.parametrize("burst", [False, True])
def test_head_worker_schedules_through_its_thread(redis_server, no_lua, burst):
    """`HeadWorker` swaps RQ's forked scheduler for `ThreadScheduler`, in burst mode too."""
    from workers.head.jobs.rq_worker import HeadWorker

    r = connect(redis_server.url)
    name = f"q-hw-{burst}"
    r.delete(ThreadScheduler.get_locking_key(name))
    worker = HeadWorker.__new__(HeadWorker)  # only the scheduler plumbing: no models, no RQ loop
    worker.queues = [Queue(name, connection=r, serializer=JSONSerializer)]
    worker.connection, worker.serializer, worker.scheduler = r, JSONSerializer, None
    worker.shardflow_settings = Settings()
    job = _job_due_now(r, worker.queues[0])
    worker._start_scheduler(burst=burst)
    try:
        assert isinstance(worker.scheduler, ThreadScheduler)
        deadline = time.monotonic() + 10
        while job.id not in worker.queues[0].get_job_ids() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert job.id in worker.queues[0].get_job_ids()
        assert (worker.scheduler._process is None) == burst
    finally:
        worker.stop_scheduler()
    assert not r.exists(ThreadScheduler.get_locking_key(name))
