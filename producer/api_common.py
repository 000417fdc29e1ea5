"""What `shardflow serve`'s modules share (producer/api.py, producer/api_batches.py, producer/api_stream.py):
errors in OpenAI's shape, the server's configuration, who a request comes from (`Tenant`: keys as tenants),
JSON bodies parsed within limits (size, depth), and the route host (`Host`) the batch routes are built on."""

from __future__ import annotations

import hashlib
import ipaddress
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from producer.client import Client, JobView
from producer.liveness import Liveness
from schemas.openai import error

Handler = Callable[[Request], Awaitable[Response]]


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code = status, message, kind, code

    def response(self) -> JSONResponse:
        return JSONResponse(error(self.message, self.kind, self.code), status_code=self.status)


@dataclass
class ApiConfig:
    """The server's configuration: its keys (from flags and the environment) and its limits (from Settings)."""

    keys: frozenset[str] | None  # None: no authentication (loopback only)
    max_body_bytes: int
    max_concurrent: int
    timeout_s: float
    body_timeout_s: float
    max_json_depth: int
    admin_keys: frozenset[str] = frozenset()  # keys that see every batch and file (also valid keys)
    shared_batches: bool = False  # every key sees every batch and file
    served_name: str | None = None  # the model's name (None: from what the heads announce)


@dataclass(frozen=True)
class Tenant:
    """Who a request comes from: `owner` (a digest of its key; the key itself is never stored), and whether it
    sees every batch and file (an admin key, `--shared-batches`, or a server without keys) or only its own."""

    owner: str
    sees_all: bool

    def may_see(self, owner: str | None) -> bool:
        """Whether this tenant may see what `owner` made (None: made outside the API, e.g. by the CLI)."""
        return self.sees_all or (owner is not None and owner == self.owner)


def owner_of(key: str) -> str:
    """The owner id of an API key: a digest of it (what batch and file records keep)."""
    return hashlib.sha256(b"shardflow-api-owner\0" + key.encode()).hexdigest()[:32]


def depth(value: object) -> int:
    """How deeply a parsed JSON value nests arrays and objects (without recursion)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, level = todo.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        todo.extend((child, level + 1) for child in children if isinstance(child, dict | list))
    return deepest


def parse_json(data: bytes, max_depth: int) -> object:
    """A request body as JSON, or a 400 in plain words: not UTF-8, nested past `max_depth`, or not JSON."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ApiError(400, "the body is not UTF-8 text") from None
    deep = ApiError(400, f"the body nests arrays or objects deeper than {max_depth} levels")
    try:
        value = json.loads(text)  # the parser's own recursion limit ends anything thousands of levels deep
    except RecursionError:
        raise deep from None
    except ValueError as e:
        msg = e.msg if isinstance(e, json.JSONDecodeError) else "invalid"
        raise ApiError(400, f"the body is not JSON: {msg}") from None
    if depth(value) > max_depth:
        raise deep
    return value


def loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Host(Protocol):
    """What routes get from the server (producer/api.py's Api)."""

    client: Client
    config: ApiConfig
    liveness: Liveness

    def guard(self, handler: Handler) -> Handler: ...

    def tenant(self, request: Request) -> Tenant: ...

    async def body(self, request: Request) -> bytes: ...

    async def json_body(self, request: Request) -> object: ...

    async def call(self, fn: Callable, *args: object, **kw: object) -> Any: ...

    async def views(self, job_ids: list[str]) -> list[JobView]: ...
