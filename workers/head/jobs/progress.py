"""One job's progress on the head: throttled meta (counts, speed), the committed text on the job's token stream and a
checkpoint of its tokens, flushed off the step loop on the head's flush threads (workers/head/jobs/flushes.py); and the
cancel a user asks for (`JobCancelled`). The job function (workers/head/jobs/job_function.py) makes one per job."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, wait
from dataclasses import dataclass, field

import redis
from rq.job import Job

from schemas.errors import JobError
from schemas.jobs import Checkpoint
from schemas.keys import Keys
from schemas.requests import STREAM_BROKEN_MAX
from workers.head.jobs.flushes import FlushMark, FlushPool

log = logging.getLogger("shardflow.jobs")


class JobCancelled(JobError):
    """The user cancelled a running generation."""


@dataclass
class Progress:
    """Throttled progress for one job: meta (counts, speed) + committed text on the token stream.

    Flushes between rounds run on the head's flush threads (`pool`, shared by every job of the head), so a far
    Redis's round trip never stalls the step loop (it only hands over a copy of the tokens); at most one per job
    is in flight, so token-stream entries stay in order. What a flush finds (a cancel request, a Redis error) is
    raised from `on_tokens` at the generation's next round, which fails (or cancels) that generation only."""

    job: Job
    r: redis.Redis
    keys: Keys
    tokenizer: object
    ttl: int  # of the checkpoint and the token stream: the job's result TTL
    interval_s: float  # least time between flushes (settings.jobs.progress_interval_s)
    pool: FlushPool = field(repr=False)
    started: float = field(default_factory=time.monotonic)
    last_flush: float = 0.0
    rounds: int = 0
    accepted: int = 0
    flushed_chars: int = 0
    text: str = ""
    fresh_stream: bool = True  # no checkpoint: the first write drops an earlier attempt's stale token stream
    stream_broken: str | None = None  # why the token stream is written no more (None: it holds the text so far)
    _inflight: Future | None = field(default=None, repr=False)

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
            self._inflight = self.pool.submit(self, list(generated), False)

    def wait(self) -> None:
        """Let the flush in flight finish (what it found is not raised: the generation is over)."""
        if self._inflight is not None:
            wait([self._inflight])
            self._inflight = None

    def flush(self, generated: list[int], final: bool, result_json: str | None = None) -> bool:
        """Write progress, text and checkpoint (a final flush: end the text, drop the checkpoint), in one
        round trip; `result_json` is stored first in the same round trip unless a result is there (then
        False is returned). Raises JobCancelled if the user asked to cancel. (On the head's flush threads many
        jobs' flushes share a round trip: `queue_flush`, then `took_flush`, workers/head/jobs/flushes.py.)"""
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
