"""The Python client of the job system: enqueue batches, read status and results, retry, cancel.

    client = Client(connect(url))
    batch = client.enqueue([GenerationRequest(prompt="Hello")])
    for view in client.wait(batch.batch_id): print(view.result["text"])

Jobs are RQ jobs (JSON serializer) on one queue, one per prompt, grouped under a batch id (an RQ
Group of the same name) with deterministic ids `{batch}-{index:05d}`; results are also kept,
write-once, under `{prefix}:result:{job_id}`.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field

import redis
from rq import Queue, Retry, Worker
from rq.group import Group
from rq.job import Job, JobStatus
from rq.registry import FailedJobRegistry
from rq.serializers import JSONSerializer

from schemas.errors import InvalidRequest, ShardFlowError
from schemas.jobs import RUN_GENERATION, JobKeys, ModelInfo, job_id_for
from schemas.requests import GenerationRequest
from schemas.settings import DEFAULTS
from workers.head_worker import AllowListJob

DONE = {JobStatus.FINISHED, JobStatus.FAILED, JobStatus.CANCELED, JobStatus.STOPPED}
RETRYABLE = {JobStatus.FAILED, JobStatus.CANCELED, JobStatus.STOPPED}


class NotFound(ShardFlowError):
    """No batch or job has this id (never existed, or expired)."""


@dataclass
class JobView:
    """What a user sees of one job."""

    job_id: str
    index: int
    status: str
    prompt: str = ""
    progress: dict = field(default_factory=dict)
    error: str | None = None
    result: dict | None = None

    def as_dict(self) -> dict:
        return {
            "job_id": self.job_id,
            "index": self.index,
            "status": self.status,
            "prompt": self.prompt,
            "progress": self.progress,
            "error": self.error,
            "result": self.result,
        }


@dataclass
class Batch:
    batch_id: str
    queue: str
    job_ids: list[str]


def new_batch_id() -> str:
    return time.strftime("b%Y%m%d-%H%M%S-") + secrets.token_hex(3)


def preview(req: GenerationRequest, n: int = 80) -> str:
    text = req.prompt if req.prompt is not None else (req.messages[-1].content if req.messages else "<token ids>")
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


class Client:
    """Producer-side access to ShardFlow's queue, batches and results."""

    def __init__(self, r: redis.Redis, *, prefix: str = DEFAULTS.prefix, queue: str = DEFAULTS.queue) -> None:
        self.r, self.keys, self.queue_name = r, JobKeys(prefix), queue
        # AllowListJob: counting a registry runs RQ's cleanup, which calls the failure callback a job
        # record names; a forged record must not make a producer import code (see README, Security).
        self.queue = Queue(queue, connection=r, serializer=JSONSerializer, job_class=AllowListJob)

    # --- enqueue -------------------------------------------------------------------------------
    def model_info(self) -> ModelInfo | None:
        raw = self.r.get(self.keys.model_info(self.queue_name))
        return ModelInfo.model_validate_json(raw) if raw else None

    def enqueue(
        self,
        requests: list[GenerationRequest],
        *,
        batch_id: str | None = None,
        result_ttl: int = DEFAULTS.result_ttl_s,
        retries: int = DEFAULTS.job_retries,
    ) -> Batch:
        """Enqueue one job per request under one batch, atomically; returns the batch."""
        if not requests:
            raise InvalidRequest("nothing to enqueue")
        batch_id = batch_id or new_batch_id()
        if self.r.exists(self.keys.batch(batch_id)):
            raise InvalidRequest(f"batch {batch_id} already exists")
        ids = [job_id_for(batch_id, i) for i in range(len(requests))]
        retry = Retry(max=retries, interval=DEFAULTS.retry_intervals_s[:retries] or 0) if retries > 0 else None
        datas = [
            Queue.prepare_data(
                RUN_GENERATION,
                args=(req.model_dump(mode="json"),),
                job_id=jid,
                timeout=DEFAULTS.job_timeout_s,
                result_ttl=result_ttl,
                failure_ttl=max(result_ttl, DEFAULTS.failure_ttl_s),
                retry=retry,
                meta={"batch": batch_id, "index": i, "prompt": preview(req)},
                description=f"{batch_id}[{i}]",
            )
            for i, (jid, req) in enumerate(zip(ids, requests, strict=True))
        ]
        with self.r.pipeline() as pipe:
            pipe.hset(
                self.keys.batch(batch_id),
                mapping={"queue": self.queue_name, "count": len(ids), "created_at": time.time()},
            )
            pipe.expire(self.keys.batch(batch_id), max(result_ttl, DEFAULTS.failure_ttl_s))
            Group(self.r, name=batch_id).enqueue_many(self.queue, datas, pipeline=pipe)
            pipe.execute()
        return Batch(batch_id, self.queue_name, ids)

    # --- lookup ---------------------------------------------------------------------------------
    def batch_job_ids(self, batch_id: str) -> list[str]:
        count = self.r.hget(self.keys.batch(batch_id), "count")
        if count is None:
            raise NotFound(f"unknown batch {batch_id!r}")
        return [job_id_for(batch_id, i) for i in range(int(count))]

    def resolve(self, target: str) -> list[str]:
        """Job ids of a batch id, or [job id] for a job id; NotFound otherwise."""
        if self.r.exists(self.keys.batch(target)):
            return self.batch_job_ids(target)
        if self.r.exists(Job.key_for(target)):
            return [target]
        raise NotFound(f"no batch or job {target!r}")

    def views(self, job_ids: list[str]) -> list[JobView]:
        jobs = Job.fetch_many(job_ids, connection=self.r, serializer=JSONSerializer)
        stored = self.r.mget([self.keys.result(j) for j in job_ids]) if job_ids else []
        out = []
        for i, (jid, job, res) in enumerate(zip(job_ids, jobs, stored, strict=True)):
            if job is None:
                out.append(JobView(jid, i, "expired", result=json.loads(res) if res else None))
                continue
            meta = job.meta or {}
            got = job.get_status(refresh=False)
            status = got.value if isinstance(got, JobStatus) else str(got or "unknown")
            result = json.loads(res) if res else None
            error = meta.get("error") if status in ("failed", "stopped", "canceled", "scheduled") else None
            if status == "failed" and not error:
                latest = job.latest_result()
                error = (latest.exc_string or "").strip().splitlines()[-1] if latest and latest.exc_string else "failed"
            out.append(
                JobView(
                    jid,
                    int(meta.get("index", i)),
                    status,
                    meta.get("prompt", ""),
                    meta.get("progress", {}),
                    error,
                    result,
                )
            )
        return out

    # --- actions --------------------------------------------------------------------------------
    def retry(self, job_ids: list[str]) -> list[str]:
        """Re-enqueue the failed, stopped or canceled jobs among job_ids, keeping their ids and batch."""
        done = []
        registry = FailedJobRegistry(queue=self.queue)
        for job in Job.fetch_many(job_ids, connection=self.r, serializer=JSONSerializer):
            if job is None or job.get_status(refresh=False) not in RETRYABLE:
                continue
            job.meta.pop("error", None)
            job.retries_left = DEFAULTS.job_retries
            job.save()
            self.r.delete(self.keys.cancel(job.id), self.keys.tokens(job.id))
            if job.id in registry:
                registry.requeue(job)
            else:
                self.queue.enqueue_job(job)
            done.append(job.id)
        return done

    def failed_job_ids(self) -> list[str]:
        return FailedJobRegistry(queue=self.queue).get_job_ids()

    def cancel(self, job_ids: list[str]) -> list[str]:
        """Cancel queued jobs now; ask running ones to stop at their next progress update."""
        done = []
        for job in Job.fetch_many(job_ids, connection=self.r, serializer=JSONSerializer):
            if job is None:
                continue
            status = job.get_status(refresh=False)
            if status == JobStatus.STARTED:
                self.r.set(self.keys.cancel(job.id), 1, ex=DEFAULTS.job_timeout_s)
                done.append(job.id)
            elif status not in DONE:
                job.cancel()
                done.append(job.id)
        return done

    def info(self) -> dict:
        """Queues, live workers and jobs per state, for `shardflow info`."""
        queues = []
        for q in Queue.all(connection=self.r, serializer=JSONSerializer, job_class=AllowListJob):
            queues.append(
                {
                    "queue": q.name,
                    "queued": q.count,
                    "started": q.started_job_registry.count,
                    "finished": q.finished_job_registry.count,
                    "failed": q.failed_job_registry.count,
                    "scheduled": q.scheduled_job_registry.count,
                    "canceled": q.canceled_job_registry.count,
                    "workers": Worker.count(connection=self.r, queue=q),
                }
            )
        workers = [
            {"name": w.name, "state": str(w.get_state()), "queues": w.queue_names()}
            for w in Worker.all(connection=self.r)
        ]
        return {"queues": queues, "workers": workers, "model": (m.model_dump() if (m := self.model_info()) else None)}
