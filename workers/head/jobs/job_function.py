"""The RQ job function a head worker runs.

Producers enqueue jobs by the *name* `workers.head.jobs.job_function.run_generation` (schemas.jobs.RUN_GENERATION,
a name on the wire) with one JSON argument (a GenerationRequest): the head worker's job class maps it to
`run_generation` here and refuses any other name, never importing a name a record holds (see
relay_broker/rq_jobs.py). The
function runs in the worker's own process, with the models and settings of its JobContext, and:
- returns an already stored result untouched (a re-run cannot clobber a finished result);
- publishes progress to the job's meta and committed text to a per-job token stream, throttled and off
  the step loop's path (on the head's few flush threads, `JobContext.flusher`: every flush queued goes in one
  round trip), with a checkpoint of the
  committed tokens beside them: a retried job (its head worker died) resumes there;
- never fails because of its token stream (a convenience; the result is the truth): a write Redis refuses
  (another client type-broke the key, or added an entry past the text) is reported once, in the job's meta
  (`stream_broken`) and its result's `stream_broken`, and the stream is written no more;
- ends a cancelled generation with JobCancelled, which the dispatcher records `canceled`, never failed;
- fails without retry on an invalid request, and leaves transient failures to RQ's Retry.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import Future
from dataclasses import dataclass, field

import redis
from pydantic import ValidationError
from rq import get_current_job
from rq.job import Job

from schemas.errors import InvalidRequest, NonFiniteError, ShardFlowError
from schemas.jobs import Checkpoint, job_ttl, read_result
from schemas.keys import Keys
from schemas.requests import GenerationRequest, GenerationResult
from workers.head.jobs.flushes import FlushPool
from workers.head.jobs.progress import JobCancelled, Progress
from workers.head.runtime import HeadRuntime, new_generation

log = logging.getLogger("shardflow.jobs")
FLUSH_THREADS = 2  # a head's flush threads (each round trip carries every flush queued)


@dataclass(frozen=True)
class JobContext:
    """What the job function runs with: the head's loaded models and its Redis connection and key names.
    The head worker binds it to `run_generation` in its own job class (no module global)."""

    runtime: HeadRuntime
    r: redis.Redis
    names: Keys
    # job id -> (stored result, checkpoint) as the dispatcher read them with the job's record (saves two
    # round trips per job); taken once, then read from Redis as usual
    prefetched: dict[str, tuple[bytes | None, bytes | None]] = field(default_factory=dict)
    # every job's progress flushes and final writes: a fixed few threads, each sending all that is queued in one
    # round trip (workers/head/jobs/flushes.py), however many jobs are in flight
    flusher: FlushPool = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "flusher", FlushPool(self.r, FLUSH_THREADS, "progress"))


def no_retry(job: Job, reason: str) -> None:
    """Record why a job failed and make sure RQ does not retry it."""
    job.retries_left = 0
    job.meta["error"] = reason
    job.save_meta()


def load_checkpoint(raw: bytes | None, job_id: str) -> list[int]:
    """Tokens an earlier attempt of this job committed (empty if none, or if the record is unreadable)."""
    if raw is None:
        return []
    try:
        return Checkpoint.model_validate_json(raw).token_ids
    except ValidationError as e:
        log.warning("job %s: ignoring a bad checkpoint: %s", job_id, e.errors()[0]["msg"])
        return []


def stored_result(raw: bytes | None, job_id: str) -> dict | None:
    """The result stored for this job, if one is there and reads as a result (others may write the key)."""
    data = read_result(raw)
    if raw is not None and data is None:
        log.warning("job %s: ignoring an unreadable stored result", job_id)
    return data


def finish(ctx: JobContext, job: Job, progress: Progress, result: GenerationResult, ttl: int) -> dict:
    """Store the result unless a readable one exists (kept `ttl` seconds), end the token stream and drop the
    checkpoint, in one round trip; return whichever result is stored. A stream that broke says so in it."""
    out = finish_many(ctx, [(job, progress, result, ttl)])[0]
    if isinstance(out, BaseException):
        raise out
    return out


def finish_many(ctx: JobContext, ends: list[tuple[Job, Progress, GenerationResult, int]]) -> list[dict | BaseException]:
    """`finish` for several jobs: their final writes go through the flush pool together (one round trip for all
    of them), then each job's rare leftovers (a stream that broke
    at this very write, a result another attempt stored first) one by one. What failed a job is its entry."""
    pending = []
    for _job, progress, result, _ in ends:
        data = result.model_copy(update={"stream_broken": progress.stream_broken}).model_dump(mode="json")
        pending.append((data, ctx.flusher.submit(progress, result.token_ids, True, json.dumps(data))))
    out: list[dict | BaseException] = []
    for (job, progress, _, ttl), (data, done) in zip(ends, pending, strict=True):
        try:
            out.append(_stored(ctx, job, progress, data, done.result(), ttl))
        except BaseException as e:
            out.append(e)
    return out


def _stored(ctx: JobContext, job: Job, progress: Progress, data: dict, ours: bool, ttl: int) -> dict:
    """After a job's final write: the result that is stored (ours, or the one another attempt stored first)."""
    if progress.stream_broken != data["stream_broken"]:  # it broke at this last write: amend what was stored
        data["stream_broken"] = progress.stream_broken
        pipe = ctx.r.pipeline(transaction=False)
        if ours:
            pipe.set(ctx.names.result(job.id), json.dumps(data), xx=True, ex=ttl)
        pipe.hset(job.key, "meta", job.serializer.dumps(job.meta))
        pipe.execute()
    if ours:
        return data
    key = ctx.names.result(job.id)
    existing = stored_result(ctx.r.get(key), job.id)
    if existing is None:  # unreadable: this job's own result replaces it
        ctx.r.set(key, json.dumps(data), ex=ttl)
    return existing or data


@dataclass
class Started:
    """A job's generation on the head's step loop (`future`), or the result already stored for it."""

    job: Job
    ttl: int
    stored: dict | None = None
    progress: Progress | None = None
    future: Future[GenerationResult] | None = None


def start_generation(ctx: JobContext, job: Job, payload: dict, timeout_s: float | None = None) -> Started:
    """Begin a job: its stored result if it has one; else validate the request, load its checkpoint and submit
    the generation to the head's step loop (which fails it past `timeout_s`). Never blocks on the generation."""
    raw_result, raw_checkpoint = ctx.prefetched.pop(job.id, None) or _read_keys(ctx, job.id)
    ttl = job_ttl(job, ctx.runtime.settings.jobs.result_ttl_s)
    stored = stored_result(raw_result, job.id)
    if stored is not None:
        return Started(job, ttl, stored=stored)
    try:
        req = GenerationRequest.model_validate(payload)
    except ValidationError as e:
        no_retry(job, f"invalid request: {e.errors()[0]['msg']}")
        raise InvalidRequest(job.meta["error"]) from None
    progress = Progress(
        job,
        ctx.r,
        ctx.names,
        ctx.runtime.tokenizer,
        ttl,
        ctx.runtime.settings.jobs.progress_interval_s,
        ctx.flusher,
    )
    job.meta.pop("error", None)
    job.meta.pop("stream_broken", None)  # an earlier attempt's: this one writes (or resets) the stream anew
    resume = load_checkpoint(raw_checkpoint, job.id)
    if resume:
        log.info("job %s resumes from a checkpoint of %d tokens", job.id, len(resume))
        progress.resume_from(resume)
    try:
        gen = new_generation(req, ctx.runtime, ctx.r, names=ctx.names, on_tokens=progress.on_tokens, resume=resume)
    except InvalidRequest as e:  # a prompt the head cannot take (too long, say): never worth retrying
        no_retry(job, str(e))
        raise
    return Started(job, ttl, progress=progress, future=ctx.runtime.loop_for(ctx.r).submit(gen, timeout_s))


def end_generation(ctx: JobContext, started: Started) -> dict:
    """Wait for the generation (once its Future is done this does not block) and store its result; raise what
    failed it, recorded in the job's meta (JobCancelled: the dispatcher records the job canceled)."""
    if started.stored is not None:
        return started.stored
    assert started.progress is not None
    return finish(ctx, started.job, started.progress, settle(started), started.ttl)


def settle(started: Started) -> GenerationResult:
    """The generation's result once its Future is done (its last progress flush landed); raises what failed it,
    recorded in the job's meta (JobCancelled: the dispatcher records the job canceled). Stores nothing."""
    job, progress = started.job, started.progress
    assert started.future is not None and progress is not None
    try:
        try:
            result = started.future.result()
        finally:
            progress.wait()  # no progress flush may land after what follows
    except JobCancelled:  # no failure: the dispatcher records the job canceled (and RQ never retries it)
        job.retries_left = 0
        raise
    except (InvalidRequest, NonFiniteError) as e:
        no_retry(job, f"{type(e).__name__}: {e}" if isinstance(e, NonFiniteError) else str(e))
        raise
    except ShardFlowError as e:
        job.meta["error"] = f"{type(e).__name__}: {e}"
        job.save_meta()
        raise
    return result


def run_generation(ctx: JobContext, payload: dict) -> dict:
    """RQ job: one generation (the head worker binds `ctx`), start to end in the calling thread (RQ's own
    `Job.perform`; the dispatcher uses `start_generation` / `end_generation` and no thread per job). Returns
    the GenerationResult as JSON-ready data."""
    job = get_current_job()
    if job is None:
        raise RuntimeError("run_generation must run inside a ShardFlow head worker")
    return end_generation(ctx, start_generation(ctx, job, payload))


def _read_keys(ctx: JobContext, job_id: str) -> tuple[bytes | None, bytes | None]:
    """The job's stored result and checkpoint, in one round trip."""
    pipe = ctx.r.pipeline(transaction=False)
    pipe.get(ctx.names.result(job_id))
    pipe.get(ctx.names.checkpoint(job_id))
    result, checkpoint = pipe.execute()
    return result, checkpoint
