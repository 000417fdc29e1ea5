"""What the producer API returns: job views, batches, follow events, and the errors of waiting
(producer/client.py's `Client` builds them; the CLI prints them)."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

from schemas.errors import ShardFlowError

FINAL = frozenset({"finished", "failed", "canceled", "stopped", "expired"})  # a JobView.status that stays


class NotFound(ShardFlowError):
    """No batch or job has this id (never existed, or expired)."""


@dataclass
class JobView:
    """What a user sees of one job."""

    job_id: str
    index: int
    status: str
    prompt: str = ""
    progress: dict = field(default_factory=dict)
    error: str | None = None
    result: dict | None = None
    openai: dict | None = None  # the OpenAI request it came from (schemas/openai.py JobTag), if any

    def as_dict(self) -> dict:
        """The view as JSON-ready data (`--json` / `--jsonl` output)."""
        return asdict(self)


@dataclass
class Batch:
    """An enqueued batch: its id, queue and job ids in prompt order."""

    batch_id: str
    queue: str
    job_ids: list[str]


def summary(views: list[JobView]) -> str:
    """Jobs per status in one line, e.g. `1 failed, 3 finished`."""
    return ", ".join(f"{n} {s}" for s, n in sorted(Counter(v.status for v in views).items()))


class WaitTimeout(ShardFlowError):
    """Jobs were still not all final when the deadline passed; `views` is how they stood then."""

    def __init__(self, timeout: float, views: list[JobView]) -> None:
        super().__init__(f"timed out after {timeout:.0f}s ({summary(views)})")
        self.timeout, self.views = timeout, views


@dataclass(frozen=True)
class TextChunk:
    """Text a job committed, in order (`index`: its position in the ids followed; `last`: its end marker)."""

    job_id: str
    index: int
    text: str
    last: bool


@dataclass(frozen=True)
class JobEnded:
    """A job that ended without an end marker: failed, canceled, stopped, expired, or finished, its marker lost."""

    view: JobView


@dataclass(frozen=True)
class Followed:
    """The last event of `Client.follow`: every job is final; their views, in the order followed."""

    views: list[JobView]


FollowEvent = TextChunk | JobEnded | Followed


def token_chunk(fields: dict) -> tuple[str, bool] | None:
    """(text, is the end) of a token-stream entry, or None for an entry that is not one (others can write it)."""
    text, final = fields.get(b"text"), fields.get(b"final")
    if not isinstance(text, bytes) or final not in (b"0", b"1") or len(fields) != 2:
        return None
    return text.decode("utf-8", errors="replace"), final == b"1"
