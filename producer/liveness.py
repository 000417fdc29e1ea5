"""Is a head worker alive to run a queue's jobs, and which model does it serve? What `shardflow serve` asks
before it enqueues a request (and while it waits for one), so that with no live head a request fails within
seconds instead of waiting `api.timeout_s`, and `/v1/models` lists no model nobody runs; and what the CLI's
`--wait` and `--follow` ask while they wait, to say on stderr that no head runs the jobs (producer/head_watch.py).

    look = Liveness(client).look()     # Served(name="Qwen2.5-7B-Instruct", info=ModelInfo, live=2, ...)

A head is alive while its RQ worker record (listed in RQ's registry of the queue's workers) keeps getting
heartbeats: heads beat every `heartbeat_s`, and one silent for `heartbeat_ttl_s` counts as gone (the same
bound after which its running jobs are abandoned). A record's beat is compared with this machine's clock only
the first time it is seen; after that a beat counts when its value changes, so clocks that disagree between
the head and this machine do not matter. The model is what heads announce (`{prefix}:model:{queue}`,
schemas/jobs.py ModelInfo), named stably: `--served-model-name`, else the target's hub id, or its directory's
name for a local path (never the path).
"""

from __future__ import annotations

import math
import re
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import PurePath

from pydantic import ValidationError
from rq.worker_registration import WORKERS_BY_QUEUE_KEY

from producer.client import Client
from schemas.jobs import ModelInfo

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")  # "Qwen/Qwen2.5-7B", "gpt2"; not "/x", "./x", "a/b/c"
BEAT_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"  # RQ's last_heartbeat (rq.utils.utcformat)


def stable_name(target: str) -> str:
    """The name a target is served by: a hub id as it is, a local path by its last part."""
    if HUB_ID.fullmatch(target) and not target.startswith("."):
        return target
    return PurePath(target.rstrip("/\\")).name or "model"


@dataclass(frozen=True)
class Served:
    """What one look found: the model's name (None: nothing announced), its info, live heads, and how long ago
    the last one of them beat (None: no head record at all)."""

    name: str | None
    info: ModelInfo | None
    live: int
    last_beat_s: float | None

    def why_not(self, queue: str = "this server's queue") -> str | None:
        """Why no request can run now (None: one can), in words a client may read; `queue`: how to name the
        queue (the CLI names it: `queue shardflow`)."""
        if self.live:
            return None
        if self.last_beat_s is None:
            return f"no head worker is running for {queue} (start one: shardflow head)"
        if math.isinf(self.last_beat_s):
            return f"no head worker is alive for {queue} (none has sent a heartbeat lately)"
        return f"no head worker is alive for {queue} (the last heartbeat was {self.last_beat_s:.0f}s ago)"


class Liveness:
    """Looks at a queue's head workers through the Client's connection, at most once per `api.liveness_s`."""

    def __init__(self, client: Client, served_name: str | None = None) -> None:
        self.client, self.settings, self.served_name = client, client.settings, served_name
        self.lock = threading.Lock()
        self.beats: dict[str, tuple[bytes, float]] = {}  # worker key: (last beat seen, when it was last new)
        self.last: tuple[float, Served] | None = None

    def look(self, fresh: bool = False) -> Served:
        """How the queue stands (cached for api.liveness_s; `fresh`: read now, whatever the cache holds); Redis
        errors propagate."""
        with self.lock:
            now = time.monotonic()
            if not fresh and self.last is not None and now - self.last[0] < self.settings.api.liveness_s:
                return self.last[1]
            served = self._read(now)
            self.last = (now, served)
            return served

    def forget(self) -> None:
        """Drop the cached look (the next one reads Redis)."""
        with self.lock:
            self.last = None

    def _read(self, now: float) -> Served:
        r, c = self.client.r, self.client
        with r.pipeline(transaction=False) as pipe:
            pipe.get(c.keys.model_info(c.queue_name))
            pipe.smembers(WORKERS_BY_QUEUE_KEY % c.queue_name)
            raw_info, members = pipe.execute()
        workers = sorted(m.decode(errors="replace") if isinstance(m, bytes) else str(m) for m in members)
        with r.pipeline(transaction=False) as pipe:
            for key in workers:
                pipe.hget(key, "last_heartbeat")
            beats = pipe.execute() if workers else []
        ages = [self._age(key, beat, now) for key, beat in zip(workers, beats, strict=True) if beat is not None]
        self.beats = {k: v for k, v in self.beats.items() if k in workers}
        live = sum(age <= self.settings.jobs.heartbeat_ttl_s for age in ages)
        info = _info(raw_info)
        name = None if info is None else self.served_name or stable_name(info.target)
        return Served(name, info, live, min(ages) if ages else None)

    def _age(self, key: str, beat: bytes, now: float) -> float:
        """Seconds since this worker's beat was last new: by the clocks the first time it is seen, then by
        when its value changed."""
        seen = self.beats.get(key)
        if seen is None:
            new_at = now - _clock_age(beat)
        elif seen[0] != beat:
            new_at = now
        else:
            new_at = seen[1]
        self.beats[key] = (beat, new_at)
        return max(now - new_at, 0.0)


def _clock_age(beat: bytes) -> float:
    """Seconds since an RQ heartbeat stamp by this machine's clock (a stamp that does not parse: long ago)."""
    try:
        stamp = datetime.strptime(beat.decode(), BEAT_FORMAT).replace(tzinfo=UTC)
    except (UnicodeDecodeError, ValueError):
        return float("inf")
    return max((datetime.now(UTC) - stamp).total_seconds(), 0.0)


def _info(raw: bytes | None) -> ModelInfo | None:
    try:
        return ModelInfo.model_validate_json(raw) if raw else None
    except ValidationError:
        return None
