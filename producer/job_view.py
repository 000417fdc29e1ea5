"""One job as the producer API shows it (a JobView), read from its RQ record and its stored result: what
anyone who can write Redis could have forged (meta types, the OpenAI tag, the result) is checked here.
producer/client.py's `Client.views` reads the records and calls `job_view`."""

from __future__ import annotations

from pydantic import ValidationError
from rq.job import Job, JobStatus

from producer.views import JobView
from schemas.jobs import read_result
from schemas.openai import JobTag


def _number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _tag(raw: object) -> dict | None:
    """A job's OpenAI tag as stored in its meta (anyone who can write Redis can write one): checked, else None."""
    try:
        return JobTag.model_validate(raw).model_dump(mode="json") if isinstance(raw, dict) else None
    except ValidationError:
        return None


def job_view(i: int, jid: str, job: Job | str | None, raw: bytes | None) -> JobView:
    """One job as users see it; what others could have forged is checked (types, the stored result)."""
    result = read_result(raw)
    bad = "unreadable result record" if raw is not None and result is None else None
    if job is None or isinstance(job, str):
        status, error = ("expired", bad) if job is None else ("unknown", job)
        return JobView(jid, i, status, error=error, result=result)
    meta = job.meta if isinstance(job.meta, dict) else {}
    got = job.get_status(refresh=False)
    status = got.value if isinstance(got, JobStatus) else str(got or "unknown")
    error = meta.get("error") if status in ("failed", "stopped", "canceled", "scheduled") else None
    if status == "failed" and not error:
        try:
            latest = job.latest_result()
            exc = latest.exc_string if latest is not None else None
        except Exception:  # RQ's result stream holds an entry it cannot read
            exc = None
        error = exc.strip().splitlines()[-1] if isinstance(exc, str) and exc.strip() else "failed"
    index, progress, prompt = meta.get("index", i), meta.get("progress"), meta.get("prompt")
    return JobView(
        jid,
        index if isinstance(index, int) else i,
        status,
        prompt if isinstance(prompt, str) else "",
        {k: v for k, v in progress.items() if _number(v)} if isinstance(progress, dict) else {},
        str(error) if error is not None else bad,
        result,
        _tag(meta.get("openai")),
    )
