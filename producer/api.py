"""`shardflow serve`: an OpenAI-compatible HTTP API in front of the queue (Starlette, served by uvicorn).

    shardflow serve --port 8000 --api-keys keys.txt          # or SHARDFLOW_API_KEYS=key1,key2
    client = openai.OpenAI(base_url="http://HOST:8000/v1", api_key="key1")

Every completion request becomes one RQ job, as `shardflow enqueue` makes them (bodies validated by the
pydantic models of schemas/openai.py); a streamed one (`"stream": true`) sends the job's token stream as
server-sent events, and a client that goes away cancels its job. Bearer keys are required unless the server
was started with `--no-auth` on a loopback address. Errors come in OpenAI's shape with its status codes:
400 malformed, 401 no or wrong key, 404 unknown, 413 too large, 429 too many requests at once, 500 a job
that failed, 503 Redis unreachable, 504 no result within api_timeout_s. Files and batches: producer/api_batches.py.

Why Starlette: it is the small, well-kept ASGI core that FastAPI itself is built on; the request models
already exist (schemas/openai.py), and OpenAI's error shapes are simpler to keep exact without FastAPI's
own validation layer answering 422.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.concurrency import iterate_in_threadpool, run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from producer.api_common import ApiConfig, ApiError, Handler
from producer.client import FINAL, Client, Followed, JobEnded, JobView, NotFound, TextChunk
from producer.inputs import pydantic_reason
from schemas.errors import InvalidRequest
from schemas.openai import (
    CHAT,
    TEXT,
    JobTag,
    body_for,
    chunk,
    completion,
    error,
    finish_reason,
    status_of,
    usage_chunk,
)

log = logging.getLogger("shardflow.api")


class Api:
    """The routes over one Client; `app()` is the ASGI application."""

    def __init__(self, client: Client, config: ApiConfig) -> None:
        self.client, self.config = client, config
        self.slots = asyncio.Semaphore(config.max_concurrent)

    def app(self) -> Starlette:
        from producer.api_batches import batch_routes

        routes = [
            Route("/v1/chat/completions", self.guard(lambda r: self.complete(r, CHAT)), methods=["POST"]),
            Route("/v1/completions", self.guard(lambda r: self.complete(r, TEXT)), methods=["POST"]),
            Route("/v1/models", self.guard(self.models), methods=["GET"]),
            *batch_routes(self),
        ]

        @asynccontextmanager
        async def lifespan(_app: Starlette) -> AsyncIterator[None]:
            # every request's Redis calls and every stream's reads run on worker threads: room for all of them
            anyio.to_thread.current_default_thread_limiter().total_tokens = self.config.max_concurrent + 16
            yield

        app = Starlette(routes=routes, lifespan=lifespan)
        app.add_exception_handler(404, lambda _r, _e: ApiError(404, "unknown URL", code="unknown_url").response())
        app.add_exception_handler(405, lambda _r, _e: ApiError(405, "method not allowed").response())
        return app

    # --- what every route does first -------------------------------------------------------------
    def guard(self, handler: Handler) -> Handler:
        """Authentication, the concurrency limit, and errors in OpenAI's shape around a handler."""

        async def run(request: Request) -> Response:
            try:
                self.authenticate(request)
                if self.slots.locked():
                    raise ApiError(429, "too many requests at once; retry shortly", "rate_limit_error")
                await self.slots.acquire()
                try:
                    response = await handler(request)
                except BaseException:
                    self.slots.release()
                    raise
                if isinstance(response, HeldStream):  # a stream holds its slot until it is sent or dropped
                    response.release = self.slots.release
                else:
                    self.slots.release()
                return response
            except ApiError as e:
                return e.response()
            except Exception:  # a bug, or input nothing checked: still OpenAI's shape, and a log line
                log.exception("unexpected error in %s %s", request.method, request.url.path)
                return ApiError(500, "internal error", "server_error").response()

        return run

    def authenticate(self, request: Request) -> None:
        if self.config.keys is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.encode("latin-1", errors="replace")  # as the header came (Starlette decodes latin-1)
        if scheme.lower() != "bearer" or not any(hmac.compare_digest(given, k.encode()) for k in self.config.keys):
            raise ApiError(401, "a valid API key is required (Authorization: Bearer KEY)", code="invalid_api_key")

    async def body(self, request: Request) -> bytes:
        """The request body, refused past max_body_bytes before it is all read."""
        limit = self.config.max_body_bytes
        if int(request.headers.get("content-length") or 0) > limit:
            raise ApiError(413, f"request body over {limit} bytes")
        data = bytearray()
        async for part in request.stream():
            data += part
            if len(data) > limit:
                raise ApiError(413, f"request body over {limit} bytes")
        return bytes(data)

    async def json_body(self, request: Request) -> object:
        try:
            return json.loads(await self.body(request))
        except ValueError as e:
            raise ApiError(400, f"the body is not JSON: {e}") from None

    async def call(self, fn: Callable, *args: object, **kw: object):
        """A blocking Client call off the event loop; Redis trouble is a 503."""
        try:
            return await run_in_threadpool(fn, *args, **kw)
        except ApiError:
            raise
        except NotFound as e:
            raise ApiError(404, str(e), code="not_found") from None
        except InvalidRequest as e:
            raise ApiError(400, str(e)) from None
        except Exception as e:  # Redis unreachable, a forged record: one clean error, never a traceback
            raise ApiError(503, f"the queue is unavailable: {type(e).__name__}: {e}", "server_error") from None

    # --- routes ----------------------------------------------------------------------------------
    async def models(self, _request: Request) -> Response:
        info = await self.call(self.client.model_info)
        data = [] if info is None else [{"id": info.target, "object": "model", "created": 0, "owned_by": "shardflow"}]
        return JSONResponse({"object": "list", "data": data})

    async def complete(self, request: Request, url: str) -> Response:
        raw = await self.json_body(request)
        try:
            body = body_for(url, raw)
            req = body.generation()
        except ValidationError as e:
            raise ApiError(400, pydantic_reason(e)) from None
        tag = JobTag(url=url, model=body.model)  # type: ignore[arg-type]
        bid = f"api-{secrets.token_hex(12)}"
        batch = await self.call(self.client.enqueue, [req], tags=[tag], retries=0, batch_id=bid)
        jid = batch.job_ids[0]
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            state = StreamState()
            stream = self.stream(request, jid, tag, usage, state)
            return HeldStream(stream, media_type="text/event-stream", on_drop=lambda: self.cancel(jid), state=state)
        view = await self.wait(request, jid)
        if view is None:  # the client went away (its job is cancelled): nobody reads an answer
            return Response(status_code=499)
        if view.status != "finished" or view.result is None:
            status = status_of(view.error)
            kind = "server_error" if status >= 500 else "invalid_request_error"
            raise ApiError(status, view.error or f"the request {view.status}", kind)
        return JSONResponse(completion(tag, jid, view.result))

    async def wait(self, request: Request, jid: str) -> JobView | None:
        """Poll the job until it ends; a client that disconnects first cancels it (None)."""
        deadline = time.monotonic() + self.config.timeout_s
        try:
            while True:
                (view,) = await self.call(self.client.views, [jid])
                if view.status in FINAL:
                    return view
                if time.monotonic() > deadline:
                    raise ApiError(504, f"no result within {self.config.timeout_s:.0f}s", "server_error")
                if await request.is_disconnected():
                    await self.cancel(jid)
                    return None
                await asyncio.sleep(self.client.settings.poll_interval_s)
        except BaseException:
            await self.cancel(jid)
            raise

    async def stream(
        self, request: Request, jid: str, tag: JobTag, include_usage: bool, state: StreamState
    ) -> AsyncIterator[str]:
        """The job's text as chat.completion.chunk / text_completion events, then its finish and [DONE]; a
        stream closed early (the client went away) leaves `state.ended` unset, and HeldStream cancels the job."""
        created = int(time.time())
        try:
            if tag.url == CHAT:
                yield sse(chunk(tag, jid, created, None, None, role=True))
            events = self.client.follow([jid], timeout=self.config.timeout_s)
            async for event in iterate_in_threadpool(events):
                if await request.is_disconnected():  # the client went away: `finally` cancels the job
                    return
                if isinstance(event, TextChunk) and event.text:
                    yield sse(chunk(tag, jid, created, event.text, None))
                elif isinstance(event, JobEnded | Followed):
                    view = event.view if isinstance(event, JobEnded) else event.views[0]
                    if view.status in FINAL:
                        state.ended = True
                        async for line in self.finish(view, tag, jid, created, include_usage):
                            yield line
                        return
        except Exception as e:  # Redis lost mid-stream: an error event, then the end
            yield sse(error(f"the stream broke: {type(e).__name__}: {e}", "server_error"))
            yield "data: [DONE]\n\n"

    async def cancel(self, jid: str) -> None:
        """Cancel a job whose client went away: shielded, as the request's own scope is being cancelled."""
        with anyio.CancelScope(shield=True):
            await self.call(self.client.cancel, [jid])

    async def finish(self, view: JobView, tag: JobTag, jid: str, created: int, usage: bool) -> AsyncIterator[str]:
        if view.status != "finished" or view.result is None:
            yield sse(error(view.error or f"the request {view.status}", "server_error"))
        else:
            yield sse(chunk(tag, jid, created, None, finish_reason(view.result.get("finish_reason")) or "stop"))
            if usage:
                yield sse(usage_chunk(tag, jid, created, view.result))
        yield "data: [DONE]\n\n"


@dataclass
class StreamState:
    ended: bool = False  # the stream sent the job's end: nothing to cancel


class HeldStream(StreamingResponse):
    """A streamed response that, whatever ends its ASGI call (sent, the client gone, cancelled before its body
    started), closes its body, cancels its job unless the stream sent the job's end, and gives back its
    concurrency slot."""

    release: Callable[[], None] | None = None

    def __init__(self, content, *, media_type: str, on_drop: Callable[[], Awaitable[None]], state: StreamState):
        super().__init__(content, media_type=media_type)
        self.on_drop, self.state = on_drop, state

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        try:
            await super().__call__(scope, receive, send)
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
