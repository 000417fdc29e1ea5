"""What `shardflow serve`'s modules share (producer/api.py, producer/api_batches.py): errors in OpenAI's shape,
the server's configuration, and the route host (`Host`) the batch routes are built on."""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from producer.client import Client
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
    keys: frozenset[str] | None  # None: no authentication (loopback only)
    max_body_bytes: int
    max_concurrent: int
    timeout_s: float


def loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Host(Protocol):
    """What routes get from the server (producer/api.py's Api)."""

    client: Client
    config: ApiConfig

    def guard(self, handler: Handler) -> Handler: ...

    async def body(self, request: Request) -> bytes: ...

    async def json_body(self, request: Request) -> object: ...

    async def call(self, fn: Callable, *args: object, **kw: object) -> Any: ...
