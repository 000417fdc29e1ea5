"""`shardflow serve`'s streamed completions: a job's token stream as server-sent events (chat.completion.chunk
or text_completion objects, then the finish, the usage if asked, and `[DONE]`).

Text that could still be the start of a stop sequence is held back until the next text shows it is not, or
the job ends (`StopHolder`), so a stop sequence never reaches the client (OpenAI's rule; vLLM holds back the
same way). The stream reads the job's text itself (one blocking XREAD at a time, `follow_block_ms`, taking
entries as `Client.follow` does: producer/follow.py) rather than through `Client.follow`, so that between reads
it can see the client go away, the head workers stop (an error event naming why, and the job cancelled), or
the deadline pass. What is sent in the end is the stored result's text (a stream cut short is completed).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
import redis
from starlette.requests import ClientDisconnect, Request
from starlette.responses import StreamingResponse

from producer.client import Client
from producer.follow import Streamed
from producer.views import FINAL, JobView
from schemas.openai import CHAT, JobTag, chunk, error, finish_reason, usage_chunk, visible_text

log = logging.getLogger("shardflow.api")


class StreamHost(Protocol):
    """What a stream needs of the server (producer/api.py's Api)."""

    client: Client

    async def call(self, fn: Callable, *args: object, **kw: object) -> Any: ...

    async def views(self, job_ids: list[str]) -> list[JobView]: ...

    async def no_head(self) -> str | None: ...

    def job_failure(self, view: JobView) -> tuple[int, str, str]: ...


class StopHolder:
    """Streamed text with any tail that could begin a stop sequence held back. `context` is the prompt's text
    (a stop sequence may begin in it)."""

    def __init__(self, stops: Sequence[str], context: str = "") -> None:
        self.stops = [s for s in stops if s]
        longest = max((len(s) for s in self.stops), default=0)
        self.context = context[-longest:] if longest else ""
        self.text, self.sent = "", 0

    def feed(self, text: str) -> str:
        """What of the text so far can be sent now."""
        self.text += text
        end = len(self.text) - self._held()
        out = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out

    def finish(self, final: str) -> str:
        """The rest of the final text (the stop sequence left out) once the job ended."""
        if final.startswith(self.text[: self.sent]):
            out, self.sent = final[self.sent :], len(final)
            return out
        log.warning("a stream's text differs from its job's result; the rest is not sent")
        return ""

    def _held(self) -> int:
        """Length of the longest end of the text (with the prompt before it) that begins a stop sequence."""
        whole = self.context + self.text
        held = 0
        for s in self.stops:
            for n in range(min(len(s), len(whole)), held, -1):
                if whole.endswith(s[:n]):
                    held = n
                    break
        return min(held, len(self.text))


@dataclass
class StreamState:
    ended: bool = False  # the stream sent the job's end: nothing to cancel


def read_tokens(client: Client, job_id: str, job: Streamed) -> tuple[list[str], bool]:
    """One blocking read of a job's token stream: the head's next chunks (others can write the stream: only
    the head's entries are taken, producer/follow.py), and whether it held entries. A key of another type is
    read no more (the text then comes from the result)."""
    cfg = client.settings
    if not job.reading:
        time.sleep(cfg.jobs.poll_interval_s)
        return [], False
    try:
        got = (
            client.r.xread({job.key: job.last_id}, count=cfg.jobs.follow_read_count, block=cfg.jobs.follow_block_ms)
            or []
        )
    except redis.ResponseError:
        job.unreadable = "its token stream's key holds another type"
        return [], False
    texts, fed = [], False
    for _stream, entries in got:
        for entry_id, fields in entries:
            fed = True
            if (taken := job.take(job_id, entry_id, fields)) is not None:
                texts.append(taken.text)
    return texts, fed


async def stream_events(
    api: StreamHost,
    request: Request,
    job_id: str,
    tag: JobTag,
    holder: StopHolder,
    include_usage: bool,
    state: StreamState,
    timeout_s: float,
) -> AsyncIterator[str]:
    """The job's text as events, then its finish and [DONE]; a stream closed early (the client went away)
    leaves `state.ended` unset, and HeldStream cancels the job."""
    created, deadline = int(time.time()), time.monotonic() + timeout_s
    job, seen_finished = Streamed(0, api.client.keys.tokens(job_id)), False
    try:
        if tag.url == CHAT:
            yield sse(chunk(tag, job_id, created, None, None, role=True))
        while True:
            texts, fed = await api.call(read_tokens, api.client, job_id, job)
            for text in texts:
                if out := holder.feed(text):
                    yield sse(chunk(tag, job_id, created, out, None))
            if await request.is_disconnected():
                return
            (view,) = await api.views([job_id])
            done = job.ended or not job.reading or (seen_finished and not fed)  # its text is all read
            if view.status in FINAL and (view.status != "finished" or done):
                state.ended = True
                async for line in finish(api, view, tag, job_id, created, holder, include_usage):
                    yield line
                return
            seen_finished = view.status == "finished"
            why = await api.no_head() if view.status not in FINAL else None
            if why is None and time.monotonic() > deadline:
                why = f"no result within {timeout_s:.0f}s"
            if why is not None:  # HeldStream cancels the job (state.ended stays unset)
                yield sse(error(why, "server_error"))
                yield "data: [DONE]\n\n"
                return
    except Exception as e:  # Redis lost mid-stream: an error event in plain words, then the end
        log.warning("stream of job %s broke: %s: %s", job_id, type(e).__name__, e)
        yield sse(error("the stream broke: the queue's Redis is unreachable", "server_error"))
        yield "data: [DONE]\n\n"


async def finish(
    api: StreamHost, view: JobView, tag: JobTag, job_id: str, created: int, holder: StopHolder, usage: bool
) -> AsyncIterator[str]:
    if view.status != "finished" or view.result is None:
        _status, message, kind = api.job_failure(view)
        yield sse(error(message, kind))
    else:
        result = view.result
        rest = holder.finish(visible_text(result.get("text", ""), tag.stop, result.get("finish_reason")))
        if rest:
            yield sse(chunk(tag, job_id, created, rest, None))
        yield sse(chunk(tag, job_id, created, None, finish_reason(result.get("finish_reason")) or "stop"))
        if usage:
            yield sse(usage_chunk(tag, job_id, created, result))
    yield "data: [DONE]\n\n"


class HeldStream(StreamingResponse):
    """A streamed response that, whatever ends its ASGI call (sent, the client gone, cancelled before its body
    started), closes its body, cancels its job unless the stream sent the job's end, and gives back its
    concurrency slot. A client that went away is a line in the log, not a traceback."""

    release: Callable[[], None] | None = None

    def __init__(self, content, *, media_type: str, on_drop: Callable[[], Awaitable[None]], state: StreamState):
        super().__init__(content, media_type=media_type)
        self.on_drop, self.state = on_drop, state

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        try:
            await super().__call__(scope, receive, send)
        except (ClientDisconnect, OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
            log.info("a streaming client went away (%s)", scope.get("path"))
        finally:
            with anyio.CancelScope(shield=True):
                closing = getattr(self.body_iterator, "aclose", None)
                if closing is not None:
                    await closing()
                if not self.state.ended:
                    await self.on_drop()
            if self.release is not None:
                self.release()
                self.release = None


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
