"""The RQ job function a head worker runs.

Producers enqueue jobs by the *name* `workers.head.job_function.run_generation` (schemas.jobs.RUN_GENERATION,
a name on the wire; jobs queued by earlier releases as `workers.jobs.run_generation` still run): the head
worker's job class maps it to `run_generation` here and refuses any other name,
never importing a name a record holds; see relay_broker/rq_jobs.py) with one JSON argument (a
GenerationRequest). The
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
import time
from concurrent.futures import Future, wait
from dataclasses import dataclass, field

import redis
from pydantic import ValidationError
from rq import get_current_job
from rq.job import Job

from schemas.errors import InvalidRequest, JobError, NonFiniteError, ShardFlowError
from schemas.jobs import Checkpoint, job_ttl, read_result
from schemas.keys import Keys
from schemas.requests import STREAM_BROKEN_MAX, GenerationRequest, GenerationResult
from workers.head.flushes import FlushMark, FlushPool
from workers.head.runtime import HeadRuntime, round_loop

log = logging.getLogger("shardflow.jobs")
FLUSH_THREADS = 2  # a head's flush threads (each round trip carries every flush queued)


class JobCancelled(JobError):
    """The user cancelled a running generation."""


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
    # round trip (workers/head/flushes.py), however many jobs are in flight
    flusher: FlushPool = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "flusher", FlushPool(self.r, FLUSH_THREADS, "progress"))


def no_retry(job: Job, reason: str) -> None:
    """Record why a job failed and make sure RQ does not retry it."""
    job.retries_left = 0
    job.meta["error"] = reason
    job.save_meta()


@dataclass
class Progress:
    """Throttled progress for one job: meta (counts, speed) + committed text on the token stream.

    Flushes between rounds run on the head's flush threads (`pool`), so a far Redis's round trip never
    stalls the step loop (it only hands over a copy of the tokens); at most one per job is in flight, so
    token-stream entries stay in order. What a flush finds (a cancel request, a Redis error) is raised
    from `on_tokens` at the generation's next round, which fails (or cancels) that generation only."""

    job: Job
    r: redis.Redis
    keys: Keys
    tokenizer: object
    ttl: int  # of the checkpoint and the token stream: the job's result TTL
    interval_s: float  # least time between flushes (settings.jobs.progress_interval_s)
    started: float = field(default_factory=time.monotonic)
    last_flush: float = 0.0
    rounds: int = 0
    accepted: int = 0
    flushed_chars: int = 0
    text: str = ""
    fresh_stream: bool = True  # no checkpoint: the first write drops an earlier attempt's stale token stream
    stream_broken: str | None = None  # why the token stream is written no more (None: it holds the text so far)
    pool: FlushPool | None = field(default=None, repr=False)  # default: a thread of its own
    _inflight: Future | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._own_pool = self.pool is None
        if self.pool is None:
            self.pool = FlushPool(self.r, 1, "progress")

    def resume_from(self, generated: list[int]) -> None:
        """Continue after a checkpoint: its text is on the token stream already."""
        self.text = self.tokenizer.decode(generated, skip_special_tokens=True).rstrip("\ufffd")  # type: ignore[attr-defined]
        self.flushed_chars = len(self.text)
        self.fresh_stream = False

    def on_tokens(self, new: list[int], generated: list[int]) -> None:
        self.rounds += 1
        self.accepted += max(len(new) - 1, 0)
        if self._inflight is not None:
            if not self._inflight.done():
                return  # the last flush is still on its way: the next round tries again
            self._inflight.result()  # raises what it found (JobCancelled, a Redis error)
            self._inflight = None
        if time.monotonic() - self.last_flush >= self.interval_s:
            self.last_flush = time.monotonic()
            self._inflight = self.pool.submit(self, list(generated), False)  # type: ignore[union-attr]

    def wait(self) -> None:
        """Let the flush in flight finish (what it found is not raised: the generation is over)."""
        if self._inflight is not None:
            wait([self._inflight])
            self._inflight = None
        if self._own_pool:
            self.pool.shutdown()  # type: ignore[union-attr]

    def flush(self, generated: list[int], final: bool, result_json: str | None = None) -> bool:
        """Write progress, text and checkpoint (a final flush: end the text, drop the checkpoint), in one
        round trip; `result_json` is stored first in the same round trip unless a result is there (then
        False is returned). Raises JobCancelled if the user asked to cancel. (On the head's flush threads many
        jobs' flushes share a round trip: `queue_flush`, then `took_flush`, workers/head/flushes.py.)"""
        pipe = self.r.pipeline(transaction=False)
        mark = self.queue_flush(pipe, generated, final, result_json)
        return self.took_flush(pipe.execute(raise_on_error=False)[mark.start : mark.end], mark)

    def queue_flush(
        self, pipe: redis.client.Pipeline, generated: list[int], final: bool, result_json: str | None = None
    ) -> FlushMark:
        """Append this flush's commands to `pipe` (see `flush`); what `took_flush` needs to read their answers."""
        self.last_flush = time.monotonic()
        self.text = self.tokenizer.decode(generated, skip_special_tokens=True)  # type: ignore[attr-defined]
        if not final:
            self.text = self.text.rstrip("\ufffd")  # hold back a character still being completed
        elapsed = max(self.last_flush - self.started, 1e-9)
        self.job.meta["progress"] = {
            "tokens": len(generated),
            "rounds": self.rounds,
            "tokens_per_s": round(len(generated) / elapsed, 2),
            "tokens_per_round": round(len(generated) / max(self.rounds, 1), 3),
            "accepted_per_round": round(self.accepted / max(self.rounds, 1), 3),
        }
        start = len(pipe)
        if result_json is not None:  # first: a retry finds the result, not the checkpoint
            pipe.set(self.keys.result(self.job.id), result_json, nx=True, ex=self.ttl)
        pipe.hset(self.job.key, "meta", self.job.serializer.dumps(self.job.meta))
        ckpt = self.keys.checkpoint(self.job.id)  # what a retry resumes from, consistent with the text streamed
        if final:
            pipe.delete(ckpt)
        else:
            pipe.set(ckpt, Checkpoint(token_ids=generated).model_dump_json(), ex=self.ttl)
        written = self._queue_text(pipe, final)
        pipe.exists(self.keys.cancel(self.job.id))
        mark = FlushMark(start, len(pipe), None, final=final, stores_result=result_json is not None)
        if written is not None:
            mark.stream_at, mark.entry, mark.fields = written[0] - start, written[1], written[2]
        return mark

    def took_flush(self, replies: list, mark: FlushMark) -> bool:
        """Read what Redis answered one flush's commands (`replies`: theirs alone, in order); see `flush`."""
        stream_replies = range(mark.stream_at, mark.stream_at + 2) if mark.stream_at is not None else range(0)
        for i, reply in enumerate(replies):
            if isinstance(reply, Exception) and i not in stream_replies:
                raise reply
        if mark.stream_at is not None:
            self._check_text(replies[mark.stream_at], mark.entry, mark.fields)
            self.fresh_stream = False
        cancelled = replies[-1]
        self.flushed_chars = len(self.text)
        if cancelled and not mark.final:
            raise JobCancelled("cancelled by user")
        return not mark.stores_result or bool(replies[0])

    def _queue_text(self, pipe: redis.client.Pipeline, final: bool) -> tuple[int, str, dict[bytes, bytes]] | None:
        """Queue the text not streamed yet (and, final, the end marker) on `pipe`: (where its XADD is in the
        pipeline, the entry's id and fields), or None when nothing is written (nothing new; a broken stream)."""
        delta = self.text[self.flushed_chars :]
        if self.stream_broken is not None or not (delta or final):
            return None
        stream = self.keys.tokens(self.job.id)
        # The entry id is where the text ends (sequence 1 for the end marker): if the connection drops and
        # redis-py sends the pipeline again, Redis refuses the repeated id instead of streaming the text twice.
        entry = f"{len(self.text)}-{int(final)}"
        fields = {b"text": delta.encode(), b"final": b"1" if final else b"0"}
        if self.fresh_stream:  # a retried job that starts over (producers cannot reset it: head-only writes)
            pipe.delete(stream)
        at = len(pipe)
        pipe.xadd(stream, fields, id=entry)  # type: ignore[arg-type]
        pipe.expire(stream, self.ttl)
        return at, entry, fields

    def _check_text(self, reply: object, entry: str, fields: dict[bytes, bytes]) -> None:
        """What Redis answered the stream write: a refusal that is not this very entry sent again breaks the
        stream (`_break`); the generation goes on either way."""
        if not isinstance(reply, Exception):
            return
        text = str(reply)
        if "equal or smaller" in text:
            if self._last_entry_is(entry, fields):
                return  # this pipeline ran before: redis-py sent it again after a dropped connection
            self._break("another client added an entry past its text (Redis refuses the head's later entries)")
        elif text.startswith("WRONGTYPE"):
            self._break("another client replaced it with a key of another type")
        else:
            self._break(f"Redis refused the head's write: {text}")

    def _last_entry_is(self, entry: str, fields: dict[bytes, bytes]) -> bool:
        """Whether the stream's last entry is this one (unreadable, say to a head without XREVRANGE: no)."""
        try:
            last = self.r.xrevrange(self.keys.tokens(self.job.id), count=1)
        except redis.ResponseError:
            return False
        return bool(last) and last[0][0] == entry.encode() and last[0][1] == fields

    def _break(self, reason: str) -> None:
        """Stop writing the token stream and say why: in the job's meta (written with the next flush's), in
        the result (`finish`), and once in the log. Followers fall back to the stored result's text."""
        self.stream_broken = f"the token stream broke: {reason}"[:STREAM_BROKEN_MAX]
        self.job.meta["stream_broken"] = self.stream_broken
        log.warning("job %s: %s; not written again (the result holds the text)", self.job.id, self.stream_broken)


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
    of them; a Progress with a pool of its own writes alone), then each job's rare leftovers (a stream that broke
    at this very write, a result another attempt stored first) one by one. What failed a job is its entry."""
    pending = []
    for _job, progress, result, _ in ends:
        data = result.model_copy(update={"stream_broken": progress.stream_broken}).model_dump(mode="json")
        if progress._own_pool:  # its pool is shut down once the generation ended (Progress.wait)
            done: Future = Future()
            try:
                done.set_result(progress.flush(result.token_ids, final=True, result_json=json.dumps(data)))
            except BaseException as e:
                done.set_exception(e)
        else:
            done = ctx.flusher.submit(progress, result.token_ids, True, json.dumps(data))
        pending.append((data, done))
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
        pool=ctx.flusher,
    )
    job.meta.pop("error", None)
    job.meta.pop("stream_broken", None)  # an earlier attempt's: this one writes (or resets) the stream anew
    resume = load_checkpoint(raw_checkpoint, job.id)
    if resume:
        log.info("job %s resumes from a checkpoint of %d tokens", job.id, len(resume))
        progress.resume_from(resume)
    try:
        loop = round_loop(req, ctx.runtime, ctx.r, names=ctx.names, on_tokens=progress.on_tokens, resume=resume)
    except InvalidRequest as e:  # a prompt the head cannot take (too long, say): never worth retrying
        no_retry(job, str(e))
        raise
    return Started(job, ttl, progress=progress, future=ctx.runtime.loop_for(ctx.r).submit(loop, timeout_s))


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
