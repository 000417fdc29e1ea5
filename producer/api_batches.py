"""`shardflow serve`'s files and batches (OpenAI's Batch API) over ShardFlow batches of RQ jobs.

    POST /v1/files (purpose=batch)        store an input file (expires with the results, `result_ttl_s`)
    GET  /v1/files/{id}[/content]         a stored file; `file-out-BATCH` / `file-err-BATCH`: a batch's output
                                          (succeeded requests) and errors (failed and cancelled ones), made
                                          from its jobs: byte-identical on every download once it has ended
    POST /v1/batches                      {input_file_id, endpoint, completion_window}: one job per line
    GET  /v1/batches[/{id}]               status from the jobs: validating is instant, then in_progress,
                                          completed (every job ended), cancelling / cancelled
    POST /v1/batches/{id}/cancel          cancel the jobs not ended

Keys are tenants: a file or batch belongs to the key that made it (its record keeps a digest of the key), and
any other key gets the 404 of one that does not exist. An admin key (`--admin-keys`), `--shared-batches`, or a
server without keys sees every one, and only those reach batches made outside the API (by the CLI).

Input lines are validated as `shardflow enqueue --file` validates them (all or nothing, errors by line), and
must name the model served: `--served-model-name`, else the one the heads announced (while neither is known,
every line is refused, naming the line). Records others can write (the batch hash, a file) are checked where
they are read. Times in a batch and its output lines are stored ones (created, and ended when first seen
ended), never the time of the read.
"""

from __future__ import annotations

import json
import secrets
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from producer.api_common import ApiError, Host, Tenant
from producer.inputs import Parsed, read_jsonl_text
from producer.openai_out import line_for
from producer.views import FINAL, JobView
from schemas.openai import CHAT, TEXT

WINDOWS = ("24h",)
WINDOW_S = 24 * 3600


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
        whole = await self.api.body(request)  # read whole, within the limits, before the route ran

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
        except Exception:  # not multipart
            raise ApiError(400, "expected a multipart upload with `file` and `purpose`") from None
        finally:
            if form is not None:
                await form.close()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            raise ApiError(400, "the file is not UTF-8 text") from None
        fid, now = f"file-{secrets.token_hex(12)}", int(time.time())
        name = (upload.filename or "upload.jsonl")[:256]
        owner = self.api.tenant(request).owner
        meta = {"filename": name, "purpose": "batch", "bytes": len(data), "created_at": now, "owner": owner}
        ttl = self.client.settings.jobs.result_ttl_s
        await self.api.call(self._store, fid, meta | {"content": data}, ttl)
        return JSONResponse(file_object(fid, name, len(data), now))

    def _store(self, fid: str, meta: dict, ttl: int) -> None:
        with self.r.pipeline() as pipe:
            pipe.hset(self.keys.api_file(fid), mapping=meta)
            pipe.expire(self.keys.api_file(fid), ttl)
            pipe.execute()

    def _stored(self, fid: str, tenant: Tenant) -> dict:
        """A stored file the tenant may see; else the 404 of one that does not exist."""
        raw = self.r.hgetall(self.keys.api_file(fid))
        try:
            owner = raw.get(b"owner")
            if not tenant.may_see(owner.decode() if owner is not None else None):
                raise KeyError("owner")
            return {
                "filename": raw[b"filename"].decode(),
                "bytes": int(raw[b"bytes"]),
                "created_at": int(raw[b"created_at"]),
                "content": raw[b"content"].decode("utf-8"),
            }
        except (KeyError, ValueError, UnicodeDecodeError):
            raise ApiError(404, f"no file {fid[:80]!r}", code="file_not_found") from None

    async def file_info(self, request: Request) -> Response:
        fid, tenant = request.path_params["file_id"], self.api.tenant(request)
        if fid.startswith(("file-out-", "file-err-")):
            text, rec = await self._output(fid, tenant)
            return JSONResponse(file_object(fid, f"{fid}.jsonl", len(text.encode()), _int(rec.get("created_at"))))
        f = await self.api.call(self._stored, fid, tenant)
        return JSONResponse(file_object(fid, f["filename"], f["bytes"], f["created_at"]))

    async def file_content(self, request: Request) -> Response:
        fid, tenant = request.path_params["file_id"], self.api.tenant(request)
        if fid.startswith(("file-out-", "file-err-")):
            text, _rec = await self._output(fid, tenant)
        else:
            text = (await self.api.call(self._stored, fid, tenant))["content"]
        return Response(text, media_type="application/jsonl")

    async def _output(self, fid: str, tenant: Tenant) -> tuple[str, dict[str, str]]:
        """A batch's output (succeeded) or error (failed, cancelled) file, from its jobs that ended; its record."""
        errors, bid = fid.startswith("file-err-"), fid.removeprefix("file-out-").removeprefix("file-err-")
        rec = await self._own(bid, tenant, file_id=fid)
        views = await self._views(bid)
        return await self.api.call(output_text, views, errors, _int(rec.get("created_at"))), rec

    # --- batches ---------------------------------------------------------------------------------
    async def create(self, request: Request) -> Response:
        body = await self.api.json_body(request)
        if not isinstance(body, dict) or not isinstance(body.get("input_file_id"), str):
            raise ApiError(400, "give input_file_id, endpoint and completion_window")
        endpoint, window = body.get("endpoint"), body.get("completion_window", "24h")
        if not isinstance(endpoint, str) or endpoint not in (CHAT, TEXT):
            raise ApiError(400, f"endpoint must be {CHAT} or {TEXT}")
        if not isinstance(window, str) or window not in WINDOWS:
            raise ApiError(400, "completion_window must be 24h")
        extra = set(body) - {"input_file_id", "endpoint", "completion_window", "metadata"}
        if extra:
            raise ApiError(400, f"{sorted(extra)[0][:64]}: not a parameter this server takes")
        tenant = self.api.tenant(request)
        f = await self.api.call(self._stored, body["input_file_id"], tenant)
        parsed: Parsed = await self.api.call(
            read_jsonl_text, f["content"], self.client.settings.generation
        )  # up to max_body_bytes: off the loop
        errors = parsed.errors or [
            f"{where}: not a Batch API line" if t is None else f"{where}: url {t.url} is not the batch's endpoint"
            for where, t in zip(parsed.sources, parsed.tags, strict=True)
            if t is None or t.url != endpoint
        ]
        if errors or not parsed.requests:
            raise ApiError(400, "; ".join(errors[:5]) or "the input file holds no requests")
        await self._check_models(parsed)
        bid, now = f"batch_{secrets.token_hex(12)}", int(time.time())
        record = {
            "openai_input_file_id": body["input_file_id"],
            "openai_endpoint": endpoint,
            "openai_window": window,
            "openai_owner": tenant.owner,
        }
        await self.api.call(self._enqueue, bid, parsed, record, now, tenant.owner)
        return JSONResponse(await self._object(bid, tenant))

    async def _check_models(self, parsed: Parsed) -> None:
        """Every line names the model served: `--served-model-name`, else the one the queue's heads announced
        (an announcement outlives its head: a batch may wait for the next one). With neither, no line's model
        can be checked, and every line is refused rather than run later by whatever model a head brings."""
        name = self.api.config.served_name
        if name is None:  # read now: a cached look may predate a head's first announcement
            name = (await self.api.call(self.api.liveness.look, fresh=True)).name
        if name is None:
            why = "cannot be checked"
            hint = " (no head worker has announced its model yet: start one, or serve with --served-model-name)"
        else:
            why, hint = "is not served here", " (GET /v1/models lists what is)"
        wrong = [
            f"{where}: the model {t.model[:64]!r} {why}"
            for where, t in zip(parsed.sources, parsed.tags, strict=True)
            if t is not None and t.model != name
        ]
        if wrong:
            raise ApiError(400, "; ".join(wrong[:5]) + hint, code="model_not_found")

    def _enqueue(self, bid: str, parsed: Parsed, record: dict, now: int, owner: str) -> None:
        self.client.enqueue(parsed.requests, batch_id=bid, tags=parsed.tags)
        ttl = self.client.settings.jobs.result_ttl_s
        with self.r.pipeline() as pipe:
            pipe.hset(self.keys.batch(bid), mapping=record)
            for index in (self.keys.api_batches, self.keys.api_owner_batches(owner)):
                pipe.zadd(index, {bid: now})
                pipe.zremrangebyscore(index, 0, now - ttl)  # batches whose records expired
                pipe.expire(index, ttl)
            pipe.execute()

    async def _views(self, bid: str) -> list[JobView]:
        ids = await self.api.call(self.client.batch_job_ids, bid)
        return await self.api.views(ids)

    def _record(self, bid: str) -> dict[str, str]:
        raw = self.r.hgetall(self.keys.batch(bid))
        return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in raw.items()}

    async def _own(self, bid: str, tenant: Tenant, file_id: str | None = None) -> dict[str, str]:
        """The batch's record if the tenant may see the batch; else the 404 of one that does not exist."""
        rec = await self.api.call(self._record, bid)
        if not tenant.may_see(rec.get("openai_owner")):
            if file_id is not None:
                raise ApiError(404, f"no file {file_id[:80]!r}", code="file_not_found")
            raise ApiError(404, f"unknown batch {bid[:80]!r}", code="not_found")
        return rec

    async def _object(self, bid: str, tenant: Tenant) -> dict:
        rec = await self._own(bid, tenant)
        views = await self._views(bid)
        ended = bool(views) and all(v.status in FINAL for v in views)
        if ended and "openai_ended_at" not in rec and rec:
            rec["openai_ended_at"] = str(int(time.time()))  # stamped once: every later read shows the same time
            await self.api.call(self.r.hset, self.keys.batch(bid), "openai_ended_at", rec["openai_ended_at"])
        return batch_object(bid, rec, views)

    async def retrieve(self, request: Request) -> Response:
        return JSONResponse(await self._object(request.path_params["batch_id"], self.api.tenant(request)))

    async def listing(self, request: Request) -> Response:
        raw_limit = request.query_params.get("limit", "20")
        if not raw_limit.isdigit():
            raise ApiError(400, "limit must be a whole number from 1 to 100")
        limit = min(max(int(raw_limit), 1), 100)
        tenant = self.api.tenant(request)
        index = self.keys.api_batches if tenant.sees_all else self.keys.api_owner_batches(tenant.owner)
        ids = await self.api.call(self.r.zrange, index, 0, limit - 1, desc=True)
        out = []
        for raw in ids:
            try:
                out.append(await self._object(raw.decode(errors="replace"), tenant))
            except ApiError:  # expired, or a forged entry: left out
                continue
        return JSONResponse({"object": "list", "data": out, "has_more": False})

    async def cancel(self, request: Request) -> Response:
        bid, tenant = request.path_params["batch_id"], self.api.tenant(request)
        rec = await self._own(bid, tenant)
        views = await self._views(bid)
        await self.api.call(self.client.cancel, [v.job_id for v in views if v.status not in FINAL])
        if rec.get("openai_cancelled") != "1":
            mark = {"openai_cancelled": "1", "openai_cancelling_at": str(int(time.time()))}
            await self.api.call(lambda: self.r.hset(self.keys.batch(bid), mapping=mark))
        return JSONResponse(await self._object(bid, tenant))


def output_text(views: list[JobView], errors: bool, created: int) -> str:
    """A batch's output file (its succeeded requests) or error file (its failed and cancelled ones), from the
    jobs that ended; each completion stamped `created` (the batch's creation), so the bytes never change."""
    lines = [line_for(v, created=created, detail=False) for v in views if v.status in FINAL]
    keep = [x for x in lines if (x["error"] is not None) == errors]
    return "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in keep)


def file_object(fid: str, name: str, size: int, created: int, purpose: str = "batch") -> dict:
    return {
        "id": fid,
        "object": "file",
        "bytes": size,
        "created_at": created,
        "filename": name,
        "purpose": purpose if not fid.startswith(("file-out-", "file-err-")) else "batch_output",
        "status": "processed",
    }


def batch_object(bid: str, rec: dict[str, str], views: list[JobView]) -> dict:
    """OpenAI's batch object from a ShardFlow batch's record and jobs. `failed` counts every request in the
    error file (failed or cancelled), so that an ended batch's completed + failed is its total."""
    done = sum(v.status == "finished" for v in views)
    failed = sum(v.status in FINAL and v.status != "finished" for v in views)
    ended = done + failed == len(views)
    cancelled = rec.get("openai_cancelled") == "1"
    status = ("cancelled" if ended else "cancelling") if cancelled else "completed" if ended else "in_progress"
    created, ended_at = _int(rec.get("created_at")), _int(rec.get("openai_ended_at")) or None
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
        "finalizing_at": ended_at if ended and not cancelled else None,
        "completed_at": ended_at if ended and not cancelled else None,
        "cancelling_at": _int(rec.get("openai_cancelling_at")) or None if cancelled else None,
        "cancelled_at": ended_at if cancelled and ended else None,
        "expires_at": created + WINDOW_S,
        "request_counts": {"total": len(views), "completed": done, "failed": failed},
        "metadata": None,
    }


def _int(raw: str | None) -> int:
    try:
        return int(float(raw or 0))
    except (ValueError, OverflowError):  # a forged record: "x", "inf"
        return 0
