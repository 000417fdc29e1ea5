"""`shardflow serve`'s files and batches (OpenAI's Batch API) over ShardFlow batches of RQ jobs.

    POST /v1/files (purpose=batch)        store an input file (expires with the results, `result_ttl_s`)
    GET  /v1/files/{id}[/content]         a stored file; `file-out-BATCH` / `file-err-BATCH`: a batch's output
                                          (succeeded requests) and errors (failed ones), made from its jobs
    POST /v1/batches                      {input_file_id, endpoint, completion_window}: one job per line
    GET  /v1/batches[/{id}]               status from the jobs: validating is instant, then in_progress,
                                          completed (every job ended), cancelling / cancelled
    POST /v1/batches/{id}/cancel          cancel the jobs not ended

Input lines are validated as `shardflow enqueue --file` validates them (all or nothing, errors by line).
Records others can write (the batch hash, a file) are checked where they are read.
"""

from __future__ import annotations

import json
import secrets
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from producer.api_common import ApiError, Host
from producer.inputs import read_jsonl_text
from producer.openai_out import line_for
from producer.views import FINAL, JobView
from schemas.openai import CHAT, TEXT

WINDOWS = ("24h",)


def batch_routes(api: Host) -> list[Route]:
    b = Batches(api)
    return [
        Route("/v1/files", api.guard(b.upload), methods=["POST"]),
        Route("/v1/files/{file_id}", api.guard(b.file_info), methods=["GET"]),
        Route("/v1/files/{file_id}/content", api.guard(b.file_content), methods=["GET"]),
        Route("/v1/batches", api.guard(b.create), methods=["POST"]),
        Route("/v1/batches", api.guard(b.listing), methods=["GET"]),
        Route("/v1/batches/{batch_id}", api.guard(b.retrieve), methods=["GET"]),
        Route("/v1/batches/{batch_id}/cancel", api.guard(b.cancel), methods=["POST"]),
    ]


class Batches:
    def __init__(self, api: Host) -> None:
        self.api, self.client = api, api.client
        self.r, self.keys = api.client.r, api.client.keys

    # --- files -----------------------------------------------------------------------------------
    async def upload(self, request: Request) -> Response:
        limit = self.api.config.max_body_bytes
        whole = await self.api.body(request)  # refused past the limit as it arrives, whatever its headers say

        async def replay() -> dict:
            return {"type": "http.request", "body": whole, "more_body": False}

        form = None
        try:
            form = await Request(request.scope, replay).form(max_files=1, max_fields=8, max_part_size=limit)
            upload, purpose = form.get("file"), form.get("purpose")
            if purpose != "batch" or upload is None or isinstance(upload, str):
                raise ApiError(400, "give `file` and `purpose` = batch (the only purpose this server keeps)")
            data = await upload.read()
        except ApiError:
            raise
        except Exception as e:  # not multipart
            raise ApiError(400, f"expected a multipart upload with `file` and `purpose`: {e}") from None
        finally:
            if form is not None:
                await form.close()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            raise ApiError(400, "the file is not UTF-8 text") from None
        fid, now = f"file-{secrets.token_hex(12)}", int(time.time())
        name = (upload.filename or "upload.jsonl")[:256]
        meta = {"filename": name, "purpose": "batch", "bytes": len(data), "created_at": now, "content": data}
        ttl = self.client.settings.result_ttl_s
        await self.api.call(self._store, fid, meta, ttl)
        return JSONResponse(file_object(fid, name, len(data), now))

    def _store(self, fid: str, meta: dict, ttl: int) -> None:
        with self.r.pipeline() as pipe:
            pipe.hset(self.keys.api_file(fid), mapping=meta)
            pipe.expire(self.keys.api_file(fid), ttl)
            pipe.execute()

    def _stored(self, fid: str) -> dict:
        raw = self.r.hgetall(self.keys.api_file(fid))
        try:
            return {
                "filename": raw[b"filename"].decode(),
                "bytes": int(raw[b"bytes"]),
                "created_at": int(raw[b"created_at"]),
                "content": raw[b"content"].decode("utf-8"),
            }
        except (KeyError, ValueError, UnicodeDecodeError):
            raise ApiError(404, f"no file {fid!r}", code="file_not_found") from None

    async def file_info(self, request: Request) -> Response:
        fid = request.path_params["file_id"]
        if fid.startswith(("file-out-", "file-err-")):
            text = await self._output(fid)
            return JSONResponse(file_object(fid, f"{fid}.jsonl", len(text.encode()), 0, "batch_output"))
        f = await self.api.call(self._stored, fid)
        return JSONResponse(file_object(fid, f["filename"], f["bytes"], f["created_at"]))

    async def file_content(self, request: Request) -> Response:
        fid = request.path_params["file_id"]
        if fid.startswith(("file-out-", "file-err-")):
            text = await self._output(fid)
        else:
            text = (await self.api.call(self._stored, fid))["content"]
        return Response(text, media_type="application/jsonl")

    async def _output(self, fid: str) -> str:
        """A batch's output (succeeded) or error (failed) file, from its jobs that ended."""
        errors, bid = fid.startswith("file-err-"), fid.removeprefix("file-out-").removeprefix("file-err-")
        views = await self._views(bid)
        return await self.api.call(output_text, views, errors)

    # --- batches ---------------------------------------------------------------------------------
    async def create(self, request: Request) -> Response:
        body = await self.api.json_body(request)
        if not isinstance(body, dict) or not isinstance(body.get("input_file_id"), str):
            raise ApiError(400, "give input_file_id, endpoint and completion_window")
        endpoint, window = body.get("endpoint"), body.get("completion_window", "24h")
        if endpoint not in (CHAT, TEXT):
            raise ApiError(400, f"endpoint must be {CHAT} or {TEXT}")
        if window not in WINDOWS:
            raise ApiError(400, "completion_window must be 24h")
        f = await self.api.call(self._stored, body["input_file_id"])
        parsed = await self.api.call(read_jsonl_text, f["content"])  # up to max_body_bytes: off the event loop
        errors = parsed.errors or [
            f"{where}: not a Batch API line" if t is None else f"{where}: url {t.url} is not the batch's endpoint"
            for where, t in zip(parsed.sources, parsed.tags, strict=True)
            if t is None or t.url != endpoint
        ]
        if errors or not parsed.requests:
            raise ApiError(400, "; ".join(errors[:5]) or "the input file holds no requests")
        bid, now = f"batch_{secrets.token_hex(12)}", int(time.time())
        record = {"openai_input_file_id": body["input_file_id"], "openai_endpoint": endpoint, "openai_window": window}
        await self.api.call(self._enqueue, bid, parsed, record, now)
        return JSONResponse(await self._object(bid))

    def _enqueue(self, bid: str, parsed, record: dict, now: int) -> None:
        self.client.enqueue(parsed.requests, batch_id=bid, tags=parsed.tags)
        ttl = self.client.settings.result_ttl_s
        with self.r.pipeline() as pipe:
            pipe.hset(self.keys.batch(bid), mapping=record)
            pipe.zadd(self.keys.api_batches, {bid: now})
            pipe.zremrangebyscore(self.keys.api_batches, 0, now - ttl)  # batches whose records expired
            pipe.expire(self.keys.api_batches, ttl)
            pipe.execute()

    async def _views(self, bid: str) -> list[JobView]:
        return await self.api.call(lambda: self.client.views(self.client.batch_job_ids(bid)))

    def _record(self, bid: str) -> dict[str, str]:
        raw = self.r.hgetall(self.keys.batch(bid))
        return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in raw.items()}

    async def _object(self, bid: str) -> dict:
        views = await self._views(bid)
        rec = await self.api.call(self._record, bid)
        return batch_object(bid, rec, views)

    async def retrieve(self, request: Request) -> Response:
        return JSONResponse(await self._object(request.path_params["batch_id"]))

    async def listing(self, request: Request) -> Response:
        raw_limit = request.query_params.get("limit", "20")
        if not raw_limit.isdigit():
            raise ApiError(400, "limit must be a whole number from 1 to 100")
        limit = min(max(int(raw_limit), 1), 100)
        ids = await self.api.call(self.r.zrange, self.keys.api_batches, 0, limit - 1, desc=True)
        out = []
        for raw in ids:
            try:
                out.append(await self._object(raw.decode(errors="replace")))
            except Exception:  # expired, or a forged entry: left out
                continue
        return JSONResponse({"object": "list", "data": out, "has_more": False})

    async def cancel(self, request: Request) -> Response:
        bid = request.path_params["batch_id"]
        views = await self._views(bid)
        await self.api.call(self.client.cancel, [v.job_id for v in views if v.status not in FINAL])
        await self.api.call(self.r.hset, self.keys.batch(bid), "openai_cancelled", "1")
        return JSONResponse(await self._object(bid))


def output_text(views: list[JobView], errors: bool) -> str:
    """A batch's output file (its succeeded requests) or error file (its failed ones), from the jobs that ended."""
    lines = [line_for(v) for v in views if v.status in FINAL]
    keep = [x for x in lines if (x["error"] is not None) == errors]
    return "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in keep)


def file_object(fid: str, name: str, size: int, created: int, purpose: str = "batch") -> dict:
    return {
        "id": fid,
        "object": "file",
        "bytes": size,
        "created_at": created,
        "filename": name,
        "purpose": purpose,
        "status": "processed",
    }


def batch_object(bid: str, rec: dict[str, str], views: list[JobView]) -> dict:
    """OpenAI's batch object from a ShardFlow batch's record and jobs."""
    done = sum(v.status == "finished" for v in views)
    failed = sum(v.status in FINAL and v.status != "finished" for v in views)
    ended = done + failed == len(views)
    cancelled = rec.get("openai_cancelled") == "1"
    status = ("cancelled" if ended else "cancelling") if cancelled else "completed" if ended else "in_progress"
    created = _int(rec.get("created_at"))
    return {
        "id": bid,
        "object": "batch",
        "endpoint": rec.get("openai_endpoint", CHAT),
        "errors": None,
        "input_file_id": rec.get("openai_input_file_id"),
        "completion_window": rec.get("openai_window", "24h"),
        "status": status,
        "output_file_id": f"file-out-{bid}" if ended and done else None,
        "error_file_id": f"file-err-{bid}" if ended and failed else None,
        "created_at": created,
        "in_progress_at": created,
        "completed_at": None if not ended or cancelled else int(time.time()),
        "cancelled_at": None if not (cancelled and ended) else int(time.time()),
        "expires_at": created + 24 * 3600,
        "request_counts": {"total": len(views), "completed": done, "failed": failed},
        "metadata": None,
    }


def _int(raw: str | None) -> int:
    try:
        return int(float(raw or 0))
    except (ValueError, OverflowError):  # a forged record: "x", "inf"
        return 0

