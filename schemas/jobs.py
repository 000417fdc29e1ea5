"""Shapes of the job system in Redis (model info, checkpoints, results) and its job-level rules (key names:
schemas/keys.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

BATCH_ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # RQ job ids (BATCH-00000) allow no "."
# The one job function producers enqueue (by name) and head workers allow: the module that defines it.
RUN_GENERATION = "workers.head.jobs.job_function.run_generation"


def job_ttl(job: object, fallback_s: int) -> int:
    """Seconds everything a job writes is kept: its RQ record's result TTL (set from `--result-ttl`), or
    `fallback_s` (the process's jobs.result_ttl_s) where the record has none usable (RQ's -1 = forever, 0, or a
    forged value)."""
    ttl = getattr(job, "result_ttl", None)
    return ttl if isinstance(ttl, int) and not isinstance(ttl, bool) and ttl > 0 else fallback_s


def read_result(raw: bytes | None) -> dict | None:
    """A stored result (`{prefix}:result:JOB`) as JSON-ready data; None if absent or unreadable (the key can
    be written by other clients: what is not a GenerationResult is not a result)."""
    from pydantic import ValidationError

    from schemas.requests import GenerationResult

    if raw is None:
        return None
    try:
        return GenerationResult.model_validate_json(raw).model_dump(mode="json")
    except ValidationError:
        return None


def job_id_for(batch_id: str, index: int) -> str:
    """Deterministic job id of the index-th prompt of a batch."""
    return f"{batch_id}-{index:05d}"


class ModelInfo(BaseModel):
    """What head workers serving a queue announce, so producers can check prompts before enqueueing."""

    model_config = ConfigDict(extra="forbid")

    v: Literal[1] = 1
    target: str
    context_length: int | None = None
    vocab_size: int
    has_chat_template: bool
    head_layers: list[int] = Field(min_length=2, max_length=2)
    draft: str | None = None


class Checkpoint(BaseModel):
    """Tokens a running job has committed, saved with its progress: a retry resumes from them."""

    model_config = ConfigDict(extra="forbid")

    v: Literal[1] = 1
    token_ids: list[int] = Field(max_length=1 << 20)
