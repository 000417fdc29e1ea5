"""The Python client of the job system: enqueue batches, wait for or follow them, read results, retry, cancel.

    from producer.client import Client
    from relay_broker.connection import connect
    from schemas.requests import GenerationRequest

    client = Client(connect("redis://localhost:6379/0"))
    batch = client.enqueue([GenerationRequest(prompt="Hello")])
    for view in client.wait(batch.job_ids, timeout=600):  # or stream the text: client.follow(batch.job_ids)
        print(view.index, view.status, view.result["text"] if view.result else view.error)

Jobs are RQ jobs (JSON serializer) on one queue, one per prompt, grouped under a batch id (an RQ
Group of the same name) with deterministic ids `{batch}-{index:05d}`; results are also kept,
write-once, under `{prefix}:result:{job_id}`.

Stop strings: a result (GenerationResult) that a stop string ended keeps it, in its text and token ids (the
generation stops after the token that completed it). OpenAI's formats leave it out: `shardflow serve`'s
responses and Batch output lines (producer/openai_out.py, schemas/openai.py `visible_text`).
"""

from __future__ import annotations

import math
import re
import secrets
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import TypeVar

import redis
from pydantic import ValidationError
from rq import Queue, Retry, Worker
from rq.group import Group
from rq.job import Job, JobStatus
from rq.registry import CanceledJobRegistry, FailedJobRegistry
from rq.serializers import JSONSerializer

from producer.follow import Streamed
from producer.job_view import job_view
from producer.views import (  # noqa: F401  (re-exported: the producer API's types)
    FINAL,
    Batch,
    Followed,
    FollowEvent,
    JobEnded,
    JobView,
    NotFound,
    StreamBroken,
    TextChunk,
    WaitTimeout,
    summary,
    token_chunk,
)
from relay_broker.retry import REDIS_LOST, ride_out
from relay_broker.rq_jobs import SafeJob
from schemas.errors import InvalidRequest, TransportError
from schemas.jobs import BATCH_ID_PATTERN, RUN_GENERATION, ModelInfo, job_id_for, job_ttl
from schemas.keys import Keys
from schemas.openai import JobTag
from schemas.requests import GenerationRequest
from schemas.settings import Settings

DONE = {JobStatus.FINISHED, JobStatus.FAILED, JobStatus.CANCELED, JobStatus.STOPPED}
RETRYABLE = {JobStatus.FAILED, JobStatus.CANCELED, JobStatus.STOPPED}
OnRetry = Callable[[BaseException, float], None]  # (the Redis error, seconds until the next attempt)
OnProgress = Callable[[list["JobView"]], None]
T = TypeVar("T")


def new_batch_id() -> str:
    return time.strftime("b%Y%m%d-%H%M%S-") + secrets.token_hex(3)


def preview(req: GenerationRequest, n: int = 80) -> str:
    text = req.prompt if req.prompt is not None else (req.messages[-1].content if req.messages else "<token ids>")
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


class Client:
    """Producer-side access to ShardFlow's queue, batches and results. `on_retry(error, seconds)`, if set,
    hears of each retry while `wait` or `follow` ride out a lost Redis (the client itself prints nothing)."""

    on_retry: OnRetry | None = None

    def __init__(
        self, r: redis.Redis, *, prefix: str | None = None, queue: str | None = None, settings: Settings | None = None
    ) -> None:
        """`settings` (default: Settings(), i.e. SHARDFLOW_* and the documented defaults) gives the queue and
        prefix (unless given here), job defaults (timeout, retries and their backoff, result TTL) and the
        poll/follow pace."""
        self.settings = settings = settings or Settings()
        prefix, queue = prefix or settings.redis.prefix, queue or settings.jobs.queue
        self.r, self.keys, self.queue_name = r, Keys(prefix), queue
        # SafeJob: RQ's cleanup (the worker's, or an operator's) calls the failure callback a job
        # record names; a forged record must not make a producer import code (see docs/security.md, "Threat model").
        self.queue = Queue(queue, connection=r, serializer=JSONSerializer, job_class=SafeJob)

    # --- enqueue -------------------------------------------------------------------------------
    def model_info(self) -> ModelInfo | None:
        """What the queue's head workers announce; None if nothing (or nothing readable) is announced."""
        raw = self.r.get(self.keys.model_info(self.queue_name))
        try:
            return ModelInfo.model_validate_json(raw) if raw else None
        except ValidationError:
            return None

    def enqueue(
        self,
        requests: list[GenerationRequest],
        *,
        batch_id: str | None = None,
        result_ttl: int | None = None,
        retries: int | None = None,
        tags: list[JobTag | None] | None = None,
    ) -> Batch:
        """Enqueue one job per request under one batch, atomically; returns the batch.

        `result_ttl` (seconds, at least 1) is the one lifetime of everything a job leaves: its RQ record and
        result (failed or not), ShardFlow's result, text stream and checkpoint, counted from when they are
        written; the batch record lasts as long from enqueueing (the batch stays listed while any of its
        jobs exists, through RQ's group of the same name). `tags`: per request, the OpenAI request it came
        from (kept in the job's meta; results can then be written in OpenAI's formats)."""
        cfg = self.settings
        result_ttl = cfg.jobs.result_ttl_s if result_ttl is None else result_ttl
        retries = cfg.jobs.retries if retries is None else retries
        if not requests:
            raise InvalidRequest("nothing to enqueue")
        if len(requests) > self.settings.jobs.max_batch_jobs:
            raise InvalidRequest(f"{len(requests)} jobs in one batch; at most {self.settings.jobs.max_batch_jobs}")
        if result_ttl < 1:
            raise InvalidRequest("result_ttl must be at least 1 second")
        batch_id = batch_id or new_batch_id()
        if not re.fullmatch(BATCH_ID_PATTERN, batch_id):
            raise InvalidRequest(f"batch id {batch_id!r} must match {BATCH_ID_PATTERN}")
        if self.r.exists(self.keys.batch(batch_id), Group.get_key(batch_id)):
            raise InvalidRequest(f"batch {batch_id} already exists")
        ids = [job_id_for(batch_id, i) for i in range(len(requests))]
        tags = tags or [None] * len(requests)
        if len(tags) != len(requests):
            raise InvalidRequest("one tag per request")
        retry = (
            Retry(max=retries, interval=self.settings.jobs.retry_intervals_s[:retries] or 0) if retries > 0 else None
        )
        datas = [
            Queue.prepare_data(
                RUN_GENERATION,
                args=(req.model_dump(mode="json"),),
                job_id=jid,
                timeout=self.settings.jobs.timeout_s,
                result_ttl=result_ttl,
                failure_ttl=result_ttl,
                retry=retry,
                meta={"batch": batch_id, "index": i, "prompt": preview(req)}
                | ({"openai": tag.model_dump(mode="json")} if tag is not None else {}),
                description=f"{batch_id}[{i}]",
            )
            for i, (jid, req, tag) in enumerate(zip(ids, requests, tags, strict=True))
        ]
        with self.r.pipeline() as pipe:
            pipe.hset(
                self.keys.batch(batch_id),
                mapping={"queue": self.queue_name, "count": len(ids), "created_at": time.time()},
            )
            pipe.expire(self.keys.batch(batch_id), result_ttl)
            Group(self.r, name=batch_id).enqueue_many(self.queue, datas, pipeline=pipe)
            pipe.execute()
        return Batch(batch_id, self.queue_name, ids)

    # --- lookup ---------------------------------------------------------------------------------
    def batch_job_ids(self, batch_id: str) -> list[str]:
        """Job ids of a batch in enqueue order: from its record, or once that expired (a queue that waited
        longer than the result TTL) from RQ's group of the same name, which lasts while any job does."""
        count = self.r.hget(self.keys.batch(batch_id), "count")
        if count is not None and count.isdigit() and int(count) <= self.settings.jobs.max_batch_jobs:
            return [job_id_for(batch_id, i) for i in range(int(count))]
        members = sorted(m.decode(errors="replace") for m in self.r.smembers(Group.get_key(batch_id)))
        if not members:
            raise NotFound(f"unknown batch {batch_id!r}")
        return members

    def resolve(self, target: str) -> list[str]:
        """Job ids of a batch id, or [job id] for a job id; NotFound otherwise."""
        if self.r.exists(self.keys.batch(target), Group.get_key(target)):
            return self.batch_job_ids(target)
        if self.r.exists(Job.key_for(target)):
            return [target]
        raise NotFound(f"no batch or job {target!r}")

    def jobs(self, job_ids: list[str]) -> list[Job | str | None]:
        """RQ jobs by id: None where a job is gone; where its record does not restore (anyone who can write
        RQ's keys can forge one), a line saying why, so one bad record never breaks a whole batch's view."""
        with self.r.pipeline(transaction=False) as pipe:
            for jid in job_ids:
                pipe.hgetall(Job.key_for(jid))
            raws = pipe.execute(raise_on_error=False)
        return [self._restore(jid, raw) for jid, raw in zip(job_ids, raws, strict=True)]

    def _restore(self, jid: str, raw: object) -> Job | str | None:
        """One job from its record's fields (see `jobs`)."""
        if isinstance(raw, redis.ResponseError):  # a key of another type where the record should be
            return f"unreadable job record ({str(raw).split(' ', 1)[0]})"
        job = SafeJob(jid, connection=self.r, serializer=JSONSerializer) if raw else None
        try:
            if job is not None:
                job.restore(raw)  # type: ignore[arg-type]  # SafeJob's: a bad field leaves `_unreadable` set
                return f"unreadable job record ({job._unreadable})" if job._unreadable else job
        except Exception as e:  # no data field at all
            return f"unreadable job record ({type(e).__name__})"
        return None

    def views(self, job_ids: list[str]) -> list[JobView]:
        """How the jobs stand, in one round trip: their records, then their results. In that order: a head
        stores a result before RQ records the job finished, so a job read finished has its result read too
        (read the other way round, a job finishing in between would look finished with no result)."""
        if not job_ids:
            return []
        with self.r.pipeline(transaction=False) as pipe:
            for jid in job_ids:
                pipe.hgetall(Job.key_for(jid))
            pipe.mget([self.keys.result(j) for j in job_ids])
            *raws, stored = pipe.execute(raise_on_error=False)
        if isinstance(stored, Exception):
            raise stored
        return [
            job_view(i, jid, self._restore(jid, raw), result)
            for i, (jid, raw, result) in enumerate(zip(job_ids, raws, stored, strict=True))
        ]

    # --- waiting ------------------------------------------------------------------------------
    def wait(
        self, job_ids: list[str], *, timeout: float | None = None, on_progress: OnProgress | None = None
    ) -> list[JobView]:
        """Poll until every job is final; their views. `on_progress(views)` hears of each poll. WaitTimeout
        once `timeout` seconds pass; Redis going away is ridden out until then (see `on_retry`)."""
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        while True:
            views = self._ride_out(lambda: self.views(job_ids), deadline)
            if on_progress is not None:
                on_progress(views)
            if all(v.status in FINAL for v in views):
                return views
            if time.monotonic() > deadline:
                raise WaitTimeout(timeout or 0.0, views)
            time.sleep(self.settings.jobs.poll_interval_s)

    def follow(self, job_ids: list[str], *, timeout: float | None = None) -> Iterator[FollowEvent]:
        """The jobs' text as it commits (TextChunk), each job that ends without an end marker (JobEnded), then
        once every job is final Followed; WaitTimeout and Redis going away as in `wait`. Token streams can be
        written by other clients (producer/follow.py): only the head's entries are taken, a key that is no
        stream is read no more, a stream not asked for is ignored, a finished job whose stream holds nothing
        more at the next read counts as ended, and a finished job's text is checked against its stored result
        (StreamBroken: completed from it, or not its text). Never a silently truncated text."""
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        jobs = {jid: Streamed(i, self.keys.tokens(jid)) for i, jid in enumerate(job_ids)}
        finished = set[str]()  # seen finished before this pass's read
        while True:
            chunks, fed = self._read_text(jobs, deadline)
            yield from chunks
            views = self._ride_out(lambda: self.views(job_ids), deadline)
            for v in views:
                job = jobs[v.job_id]
                if job.settled:
                    continue
                if v.status == "finished" and (job.ended or (v.job_id in finished and v.job_id not in fed)):
                    yield from job.settle(v)  # a read since it was seen finished found nothing more
                elif v.status in FINAL and v.status != "finished":
                    job.settled = True
                    if not job.ended:
                        yield JobEnded(v)
            finished = {v.job_id for v in views if v.status == "finished"}
            if all(v.status in FINAL for v in views) and all(j.settled for j in jobs.values()):
                yield Followed(views)
                return
            if time.monotonic() > deadline:
                raise WaitTimeout(timeout or 0.0, views)

    def _read_text(self, jobs: dict[str, Streamed], deadline: float) -> tuple[list[TextChunk], set[str]]:
        """One blocking read of the streams still followed: the head's next chunks, and the jobs whose streams
        had entries. A key of another type (it fails the whole read) is found and read no more."""
        streams = {job.key: job.last_id for job in jobs.values() if job.reading}
        if not streams:
            time.sleep(self.settings.jobs.poll_interval_s)
            return [], set()
        cfg = self.settings
        read = partial(self.r.xread, streams, count=cfg.jobs.follow_read_count, block=cfg.jobs.follow_block_ms)
        try:
            got = self._ride_out(read, deadline) or []
        except redis.ResponseError:
            if not self._drop_non_streams([j for j in jobs.values() if j.reading]):
                raise
            return [], set()
        job_of = {job.key.encode(): (jid, job) for jid, job in jobs.items()}
        chunks: list[TextChunk] = []
        fed: set[str] = set()
        for stream, entries in got:
            if stream not in job_of:
                continue
            jid, job = job_of[stream]
            fed.add(jid)
            chunks += [c for entry_id, fields in entries if (c := job.take(jid, entry_id, fields)) is not None]
        return chunks, fed

    def _drop_non_streams(self, jobs: list[Streamed]) -> int:
        """Mark the jobs whose token-stream key holds another type (another client wrote it) unreadable."""
        with self.r.pipeline(transaction=False) as pipe:
            for job in jobs:
                pipe.type(job.key)
            kinds = pipe.execute()
        bad = [(job, kind) for job, kind in zip(jobs, kinds, strict=True) if kind not in (b"stream", b"none")]
        for job, kind in bad:
            job.unreadable = f"its token stream's key holds a {kind.decode(errors='replace')}, not a stream"
        return len(bad)

    def _ride_out(self, fn: Callable[[], T], deadline: float) -> T:
        """fn(), retried while Redis is unreachable (telling `on_retry`) until the deadline; then TransportError."""
        try:
            return ride_out(fn, errors=REDIS_LOST, deadline=deadline, on_retry=self.on_retry, settings=self.settings)
        except REDIS_LOST as e:
            raise TransportError(f"Redis unreachable: {e}") from None

    # --- actions --------------------------------------------------------------------------------
    def retry(self, job_ids: list[str]) -> list[str]:
        """Re-enqueue the failed, stopped or canceled jobs among job_ids, keeping their ids and batch (taken off
        the failed or canceled registry; a job that left a checkpoint resumes from it)."""
        done = []
        registries = [FailedJobRegistry(queue=self.queue), CanceledJobRegistry(queue=self.queue)]
        for job in self.jobs(job_ids):
            if not isinstance(job, Job) or job.get_status(refresh=False) not in RETRYABLE:
                continue
            job.meta.pop("error", None)
            job.retries_left = self.settings.jobs.retries
            job.save()
            # the cancel flag only: the token stream is the head's (read only to producers); the attempt
            # that runs the retry keeps it when it resumes from a checkpoint and resets it otherwise
            self.r.delete(self.keys.cancel(job.id))
            registry = next((reg for reg in registries if job.id in reg), None)
            if registry is not None:
                registry.requeue(job)
            else:
                self.queue.enqueue_job(job)
            done.append(job.id)
        return done

    def failed_job_ids(self) -> list[str]:
        return FailedJobRegistry(queue=self.queue).get_job_ids()

    def cancel(self, job_ids: list[str]) -> list[str]:
        """Cancel queued jobs now; ask running ones to stop at their next progress update (their head records
        them `canceled`, as RQ does the queued ones: never failed)."""
        done = []
        for job in self.jobs(job_ids):
            if not isinstance(job, Job):
                continue
            status = job.get_status(refresh=False)
            if status == JobStatus.STARTED:
                self._ask_to_stop(job)
                done.append(job.id)
            elif status not in DONE:
                try:
                    job.cancel()
                except redis.ResponseError:  # a head started it meanwhile (a producer may not touch its registries)
                    if job.get_status(refresh=True) != JobStatus.STARTED:
                        raise
                    self._ask_to_stop(job)
                done.append(job.id)
        return done

    def _ask_to_stop(self, job: Job) -> None:
        """A running job's cancel flag, which its head reads at the job's next progress update or heartbeat."""
        ttl = min(self.settings.jobs.timeout_s, job_ttl(job, self.settings.jobs.result_ttl_s))  # never outlives the job
        self.r.set(self.keys.cancel(job.id), 1, ex=ttl)

    def info(self) -> dict:
        """This client's queue (`queues`: it alone, listed or not), the workers that serve it and its model, for
        `shardflow info` and `status`. Read only: registries are counted with ZCARD, not RQ's `count`, which
        first runs RQ's cleanup (it fails abandoned jobs: writes to `rq:results:*`, and calls the failure
        callback a job record names); head workers' maintenance does that cleanup. Workers whose record expired
        (dead ones, until a live worker drops them) are skipped rather than dropped here: the producer has no
        write access to RQ's worker keys."""
        live: list[dict] = []
        for key in sorted(Worker.all_keys(connection=self.r, queue=self.queue)):
            state, names = self.r.hmget(key, "state", "queues")
            if state is None and names is None:
                continue
            live.append(
                {
                    "name": key.removeprefix(Worker.redis_worker_namespace_prefix),
                    "state": state.decode() if state else "?",
                    "queues": names.decode().split(",") if names else [],
                }
            )
        states = ("started", "finished", "failed", "scheduled", "canceled")
        counts = {state: self.r.zcard(getattr(self.queue, f"{state}_job_registry").key) for state in states}
        queue = {"queue": self.queue_name, "queued": self.queue.count, **counts, "workers": len(live)}
        model = self.model_info()
        return {"queues": [queue], "workers": live, "model": model.model_dump() if model else None}
