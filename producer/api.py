"""`shardflow serve`: an OpenAI-compatible HTTP API in front of the queue (Starlette, served by uvicorn).

    shardflow serve --port 8000 --api-keys keys.txt          # or SHARDFLOW_API_KEYS=key1,key2
    client = openai.OpenAI(base_url="http://HOST:8000/v1", api_key="key1")

Every completion request becomes one RQ job, as `shardflow enqueue` makes them (bodies validated by the
pydantic models of schemas/openai.py, strictly, and parsed within size and depth limits); a streamed one
(`"stream": true`) sends the job's token stream as server-sent events (producer/api_stream.py), and a client
that goes away cancels its job. Stop sequences are left out of the text returned (OpenAI's rule). A request
names the model the head workers serve (`/v1/models`, producer/liveness.py) and needs a live head. Bearer
keys are required unless the server was started with `--no-auth` on a loopback address; each key is a
tenant of its own batches and files (producer/api_batches.py). Errors come in OpenAI's shape with its status
codes, in plain words (never an address, a path or an exception's text): 400 malformed, 401 no or wrong key,
404 unknown (`model_not_found` for a model not served), 408 a body slower than api.body_timeout_s, 413 too
large, 429 too many requests at once, 500 a job that failed, 503 no live head or Redis unreachable, 504 no
result within api.timeout_s.

Why Starlette: it is the small, well-kept ASGI core that FastAPI itself is built on; the request models
already exist (schemas/openai.py), and OpenAI's error shapes are simpler to keep exact without FastAPI's
own validation layer answering 422.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
import redis
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from producer.api_common import ApiConfig, ApiError, Handler, Tenant, owner_of, parse_json
from producer.api_stream import HeldStream, StopHolder, StreamState, stream_events
from producer.client import FINAL, Client, JobView, NotFound
from producer.liveness import Liveness, Served
from producer.openai_out import was_cancelled
from producer.reasons import plain_reason
from schemas.errors import InvalidRequest, TransportError
from schemas.openai import CHAT, TEXT, CompletionBody, body_for, completion, status_of

log = logging.getLogger("shardflow.api")
ERROR_CLASS = re.compile(r"^(InvalidRequest|NonFiniteError|ValueError|JobError): ")  # a 400 job error's prefix


class Api:
    """The routes over one Client; `app()` is the ASGI application."""

    def __init__(self, client: Client, config: ApiConfig) -> None:
        self.client, self.config = client, config
        self.slots = asyncio.Semaphore(config.max_concurrent)
        self.liveness = Liveness(client, config.served_name)

    def app(self) -> Starlette:
        from producer.api_batches import batch_routes

        routes = [
            Route("/v1/chat/completions", self.guard(lambda r: self.complete(r, CHAT)), methods=["POST"]),
            Route("/v1/completions", self.guard(lambda r: self.complete(r, TEXT)), methods=["POST"]),
            Route("/v1/models", self.guard(self.models), methods=["GET"]),
            Route("/v1/models/{model:path}", self.guard(self.model), methods=["GET"]),
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
        """Authentication, the body (read whole, within its deadline, before a slot is taken), the concurrency
        limit, and errors in OpenAI's shape around a handler."""

        async def run(request: Request) -> Response:
            try:
                request.state.tenant = self.authenticate(request)
                request.state.body = await self.read_body(request) if request.method == "POST" else b""
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
            except (ClientDisconnect, OSError):  # the client went away: nobody reads an answer
                log.info("a client went away during %s %s", request.method, request.url.path)
                return Response(status_code=499)
            except Exception:  # a bug: still OpenAI's shape, and the traceback in the log only
                log.exception("unexpected error in %s %s", request.method, request.url.path)
                return ApiError(500, "internal error", "server_error").response()

        return run

    def authenticate(self, request: Request) -> Tenant:
        if self.config.keys is None:
            return Tenant("local", sees_all=True)
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.encode("latin-1", errors="replace")  # as the header came (Starlette decodes latin-1)
        matched = None
        for key in self.config.keys:  # every key compared, in constant time each
            if hmac.compare_digest(given, key.encode()):
                matched = key
        if scheme.lower() != "bearer" or matched is None:
            raise ApiError(401, "a valid API key is required (Authorization: Bearer KEY)", code="invalid_api_key")
        return Tenant(owner_of(matched), matched in self.config.admin_keys or self.config.shared_batches)

    def tenant(self, request: Request) -> Tenant:
        return request.state.tenant

    async def read_body(self, request: Request) -> bytes:
        """The whole body, refused past max_body_bytes (413) before it is all read, and past body_timeout_s
        (408): a client that trickles its body never holds a concurrency slot, and not for long a connection."""
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length") or "0"
        if not declared.isdigit() or int(declared) > limit:
            raise ApiError(413 if declared.isdigit() else 400, f"request body over {limit} bytes")
        data = bytearray()
        try:
            with anyio.fail_after(self.config.body_timeout_s):
                async for part in request.stream():
                    data += part
                    if len(data) > limit:
                        raise ApiError(413, f"request body over {limit} bytes")
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.config.body_timeout_s:.0f}s") from None
        return bytes(data)

    async def body(self, request: Request) -> bytes:
        return request.state.body

    async def json_body(self, request: Request) -> object:
        return await run_in_threadpool(parse_json, request.state.body, self.config.max_json_depth)

    async def call(self, fn: Callable, *args: object, **kw: object):
        """A blocking Client call off the event loop; Redis trouble is a 503 in plain words (the details go
        to the log, never to the client)."""
        try:
            return await run_in_threadpool(fn, *args, **kw)
        except ApiError:
            raise
        except NotFound as e:
            raise ApiError(404, str(e), code="not_found") from None
        except InvalidRequest as e:
            raise ApiError(400, str(e)) from None
        except (redis.ConnectionError, redis.TimeoutError, TransportError, OSError) as e:
            log.warning("Redis unreachable: %s: %s", type(e).__name__, e)
            raise ApiError(503, "the queue's Redis is unreachable; retry later", "server_error") from None
        except Exception as e:  # a Redis refusal, a forged record: one clean error, never a traceback
            log.warning("the queue failed a request: %s: %s", type(e).__name__, e, exc_info=True)
            raise ApiError(503, "the queue is unavailable (the server's log says why)", "server_error") from None

    async def views(self, job_ids: list[str]) -> list[JobView]:
        """The jobs' views, where one is recorded finished but its result does not read yet (a read between
        the two writes) read again for up to api.result_grace_s."""
        cfg = self.client.settings
        views = await self.call(self.client.views, job_ids)
        deadline = time.monotonic() + cfg.api.result_grace_s
        while time.monotonic() < deadline:
            pending = [i for i, v in enumerate(views) if v.status == "finished" and v.result is None]
            if not pending:
                break
            await asyncio.sleep(cfg.jobs.poll_interval_s)
            fresh = await self.call(self.client.views, [job_ids[i] for i in pending])
            for i, view in zip(pending, fresh, strict=True):
                views[i] = view
        return views

    async def no_head(self) -> str | None:
        """Why no head can run a job now (None: one can)."""
        served: Served = await self.call(self.liveness.look)
        return served.why_not()

    def job_failure(self, view: JobView) -> tuple[int, str, str]:
        """(status, message, kind) of a job that ended without a result, in words a client may read: a request
        that can never run says why; a failure on the server says only that, with the job's id."""
        if was_cancelled(view):
            return 503, "the request was cancelled before it finished", "server_error"
        status = status_of(view.error)
        if status < 500 and view.error:
            return status, ERROR_CLASS.sub("", view.error), "invalid_request_error"
        if view.status == "finished":
            return 500, "the job finished but its result could not be read", "server_error"
        return 500, f"the request failed on the server (`shardflow status {view.job_id}` shows why)", "server_error"

    # --- routes ----------------------------------------------------------------------------------
    def _model(self, served: Served) -> dict:
        return {"id": served.name, "object": "model", "created": 0, "owned_by": "shardflow"}

    async def models(self, _request: Request) -> Response:
        served = await self.call(self.liveness.look)
        data = [self._model(served)] if served.live and served.name else []
        return JSONResponse({"object": "list", "data": data})

    async def model(self, request: Request) -> Response:
        served = await self.call(self.liveness.look)
        if not (served.live and served.name == request.path_params["model"]):
            raise ApiError(404, "no such model is served here (GET /v1/models lists it)", code="model_not_found")
        return JSONResponse(self._model(served))

    async def check_model(self, model: str) -> None:
        """404 for a model the heads do not serve, 503 with no live head (naming why)."""
        served = await self.call(self.liveness.look)
        if served.name is not None and model != served.name:
            message = f"the model {model!r} is not served here (GET /v1/models lists what is)"
            raise ApiError(404, message, code="model_not_found")
        if (why := served.why_not()) is not None:
            raise ApiError(503, why, "server_error", code="no_live_worker")

    async def complete(self, request: Request, url: str) -> Response:
        raw = await self.json_body(request)
        try:
            body = body_for(url, raw)
            req = body.generation(self.client.settings.generation)
        except ValidationError as e:
            raise ApiError(400, plain_reason(e)) from None
        await self.check_model(body.model)
        tag = body.tag(url)
        bid = f"api-{secrets.token_hex(12)}"
        batch = await self.call(self.client.enqueue, [req], tags=[tag], retries=0, batch_id=bid)
        jid = batch.job_ids[0]
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            holder = StopHolder(tag.stop, body.prompt_text() if isinstance(body, CompletionBody) else "")
            state = StreamState()
            events = stream_events(self, request, jid, tag, holder, usage, state, self.config.timeout_s)
            return HeldStream(events, media_type="text/event-stream", on_drop=lambda: self.cancel(jid), state=state)
        view = await self.wait(request, jid)
        if view is None:  # the client went away (its job is cancelled): nobody reads an answer
            return Response(status_code=499)
        if view.status != "finished" or view.result is None:
            status, message, kind = self.job_failure(view)
            raise ApiError(status, message, kind)
        return JSONResponse(completion(tag, jid, view.result))

    async def wait(self, request: Request, jid: str) -> JobView | None:
        """Poll the job until it ends; a client that disconnects first cancels it (None); no live head, or no
        result within timeout_s, cancels it too (a 503 naming why, a 504)."""
        deadline = time.monotonic() + self.config.timeout_s
        try:
            while True:
                (view,) = await self.views([jid])
                if view.status in FINAL:
                    return view
                if time.monotonic() > deadline:
                    raise ApiError(504, f"no result within {self.config.timeout_s:.0f}s", "server_error")
                if (why := await self.no_head()) is not None:
                    raise ApiError(503, why, "server_error", code="no_live_worker")
                if await request.is_disconnected():
                    await self.cancel(jid)
                    return None
                await asyncio.sleep(self.client.settings.jobs.poll_interval_s)
        except BaseException:
            await self.cancel(jid)
            raise

    async def cancel(self, jid: str) -> None:
        """Cancel a job whose client went away: shielded, as the request's own scope is being cancelled."""
        with anyio.CancelScope(shield=True):
            try:
                await self.call(self.client.cancel, [jid])
            except ApiError as e:  # Redis gone: the job runs to its end, and nobody reads it
                log.info("could not cancel job %s: %s", jid, e.message)
