"""What the head's step loop (workers/head/loop.py) and a generation on it (workers/head/rounds.py) need of the
runtime that made them (workers/head/runtime.py `HeadRuntime`, which has it without naming this protocol). The
runtime imports the loop and the rounds; they import only this, below all three: no import cycle."""

from __future__ import annotations

import threading
from typing import Protocol

from schemas.requests import GenerationRequest
from schemas.settings import Settings
from workers.engine.chain import WorkerEngine, WorkerShard
from workers.head.batching import Batcher
from workers.head.beacon import Beacons
from workers.head.link import LinkMeter
from workers.head.routes import Routes
from workers.speculative.drafters import DraftSession


class Runtime(Protocol):
    """A head's loaded models and shared parts, as the loop and its generations read them (none assigns them)."""

    @property
    def settings(self) -> Settings: ...

    @property
    def tokenizer(self) -> object: ...

    @property
    def shard(self) -> WorkerShard: ...

    @property
    def eos_token_ids(self) -> list[int]: ...

    @property
    def engine(self) -> WorkerEngine | None: ...

    @property
    def lock(self) -> threading.RLock: ...  # one batch computes at a time

    @property
    def batcher(self) -> Batcher: ...

    @property
    def beacons(self) -> Beacons: ...

    @property
    def link(self) -> LinkMeter: ...  # the head's link to Redis, from its own publishes

    @property
    def routes(self) -> Routes: ...  # the middle stages rounds go through (workers/head/routes.py)

    def drafter_for(self, req: GenerationRequest, prompt_len: int, overflow: bool = True) -> DraftSession | None:
        """The draft session a request asks for (`HeadRuntime.drafter_for`)."""
        ...

    def slot_freed(self) -> None:
        """A generation gave its cache slots back: every loop's waiting generations try again."""
        ...
