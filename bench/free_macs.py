"""Benchmark only: a worker plugin under which every MAC costs nothing (a constant tag), for an upper bound on what
faster sealing and checking could give the job path (a group's one SHA-256 over its tensors, relay protocol 4's
binding, is skipped too). Both workers must load it (each checks the other's tags).
Never for real use: it turns the relay's per-session authentication off. The product never imports bench.

    SPY=0 VARIANTS="mac=;free=--plugin bench.free_macs | --plugin bench.free_macs" NS=256 OUT=$OUT \\
        bash bench/device_round.sh 260 0 0
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import schemas.groups as groups
import schemas.macs as macs


class _NoHash:
    def update(self, data: object) -> None:
        pass

    def digest(self) -> bytes:
        return b"\0" * 32


def register(registry: Any) -> None:
    macs._mac = lambda key, direction, fields: b"\0" * 32  # type: ignore[assignment]
    groups.hashlib = SimpleNamespace(sha256=_NoHash)  # type: ignore[assignment]
