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
class StreamBroken:
    """A finished job whose token stream disagrees with its stored result: another client wrote or type-broke
    the stream (`reason` says how; the head reports what it saw in the result's `stream_broken`). `repaired`:
    what was streamed is the start of the result's text, and the rest of it follows as the job's last
    TextChunk. Otherwise what was streamed is not the job's text (`view.result["text"]` is), and a JobEnded
    follows unless an end marker came."""

    view: JobView
    reason: str
    repaired: bool


@dataclass(frozen=True)
class Followed:
    """The last event of `Client.follow`: every job is final; their views, in the order followed."""

    views: list[JobView]


FollowEvent = TextChunk | JobEnded | StreamBroken | Followed


def token_chunk(fields: dict) -> tuple[str, bool] | None:
    """(text, is the end) of a token-stream entry, or None for an entry that is not one (others can write it)."""
    text, final = fields.get(b"text"), fields.get(b"final")
    if not isinstance(text, bytes) or final not in (b"0", b"1") or len(fields) != 2:
        return None
    return text.decode("utf-8", errors="replace"), final == b"1"


def entry_end(entry_id: bytes | str) -> tuple[int, int] | None:
    """(where the text ends, in characters; 1 for an end marker, else 0) of a head's token-stream entry id
    (`END-SEQ`, workers/head/jobs/job_function.py), or None for an id that cannot be one."""
    raw = entry_id.decode(errors="replace") if isinstance(entry_id, bytes) else entry_id
    end, _, seq = raw.partition("-")
    if not (end.isascii() and end.isdigit() and seq in ("0", "1")):
        return None
    return int(end), int(seq)
