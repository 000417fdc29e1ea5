"""Results in OpenAI's Batch API output format: one line per request that ended, `{"id", "custom_id",
"response": {"status_code", "request_id", "body"}, "error"}` (schemas/openai.py), written as jobs end.

    shardflow results BATCH --format openai -o out.jsonl --follow

Lines come in completion order (join on custom_id); each is flushed as it is written, so an interrupted run
keeps what it wrote, and a run given the same file appends only the requests not yet in it (a torn last
line is cut first). Jobs enqueued without a Batch API line get their job id as custom_id.

A completion's text follows OpenAI's rule: a stop sequence that ended the generation is left out (the job's
GenerationResult, as `shardflow results` prints it, keeps it). A cancelled request is OpenAI's cancelled
line: no response, error code `batch_cancelled`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import IO

from producer.client import Client
from producer.views import FINAL, JobView, WaitTimeout
from schemas.errors import InvalidRequest
from schemas.openai import JobTag, output_line


def was_cancelled(view: JobView) -> bool:
    """A job that was cancelled: RQ's `canceled` or `stopped`, or a running one ended by its cancel flag, which
    RQ may record as failed with the head's "cancelled by user"."""
    return view.status in ("canceled", "stopped") or (view.status == "failed" and view.error == "cancelled by user")


def line_for(view: JobView, *, created: int | None = None, detail: bool = True, stops: list[str] | None = None) -> dict:
    """The output line of a job that ended (`created`, `detail`: schemas/openai.py output_line; `stops`: the
    request's stop sequences where the job has no OpenAI tag to say them)."""
    tag = JobTag.model_validate(view.openai) if view.openai else JobTag(stop=stops or [])
    if tag.custom_id is None:
        tag = tag.model_copy(update={"custom_id": view.job_id})
    ok = view.status == "finished" and view.result is not None
    error = None if ok else view.error or view.status
    return output_line(
        tag,
        view.job_id,
        view.result if ok else None,
        error,
        created=created,
        cancelled=was_cancelled(view),
        detail=detail,
    )


def request_stops(client: Client, job_ids: list[str]) -> dict[str, list[str]]:
    """The stop sequences of jobs' requests, from their records (written by producers: checked)."""
    out: dict[str, list[str]] = {}
    for jid, job in zip(job_ids, client.jobs(job_ids), strict=True):
        try:
            args = getattr(job, "args", None) if job is not None and not isinstance(job, str) else None
        except Exception:  # a record whose data does not read: no stops known
            args = None
        request = args[0] if isinstance(args, list | tuple) and args and isinstance(args[0], dict) else {}
        stop = request.get("stop")
        fits = isinstance(stop, list)
        out[jid] = [x for x in stop[:16] if isinstance(x, str) and 0 < len(x) <= 256] if fits else []
    return out


def written_ids(path: Path) -> set[str]:
    """custom_ids already in an output file; a torn last line (an interrupted write) is cut off first."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        data = data[: data.rfind(b"\n") + 1]
        path.write_bytes(data)
    ids = set()
    for n, raw in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
        try:
            obj = json.loads(raw)
        except ValueError:
            raise InvalidRequest(f"{path} line {n} is not JSON: not an output file to resume") from None
        if isinstance(obj, dict) and isinstance(obj.get("custom_id"), str):
            ids.add(obj["custom_id"])
    return ids


class Writer:
    """Appends the lines of jobs as they end, once each (`client`: to read the stop sequences of jobs enqueued
    without a Batch API line)."""

    def __init__(self, out: IO[str], skip: set[str], client: Client | None = None) -> None:
        self.out, self.done, self.client = out, set(skip), client
        self.written = 0

    def __call__(self, views: list[JobView]) -> None:
        ended = sorted((v for v in views if v.status in FINAL), key=lambda v: v.index)
        untagged = [v.job_id for v in ended if not v.openai and v.result is not None and v.job_id not in self.done]
        stops = request_stops(self.client, untagged) if self.client is not None and untagged else {}
        for v in ended:
            line = line_for(v, stops=stops.get(v.job_id))
            if line["custom_id"] in self.done:
                continue
            self.out.write(json.dumps(line, ensure_ascii=False) + "\n")
            self.out.flush()
            self.done.add(line["custom_id"])
            self.written += 1


def write_results(
    client: Client, ids: list[str], out: IO[str], skip: set[str], follow: bool, timeout: float | None
) -> tuple[list[JobView], int]:
    """Write the lines of the jobs that ended (with follow: until every job has); (views, lines written)."""
    writer = Writer(out, skip, client)
    views = client.wait(ids, timeout=timeout, on_progress=writer) if follow else client.views(ids)
    writer(views)
    return views, writer.written


def open_output(path: str | None, stdout: Callable[[], IO[str]]) -> tuple[IO[str], set[str]]:
    """The stream to append to (a file, or stdout) and the custom_ids it already holds."""
    if path is None:
        return stdout(), set()
    p = Path(path)
    try:
        skip = written_ids(p)
        return p.open("a", encoding="utf-8"), skip
    except OSError as e:
        raise InvalidRequest(f"cannot write {path}: {e.strerror or e}") from None


def results_command(client: Client, ids: list[str], output: str | None, follow: bool, timeout: float | None) -> int:
    """`shardflow results --format openai`: write the lines, say how many; the exit code (0: a request that
    failed is a line with its error, as OpenAI's batches write them; 5: --follow timed out)."""
    import click

    from producer.head_watch import HeadWatch
    from producer.options import EXIT_TIMEOUT, fail, run_guarded

    out, skip = run_guarded(lambda: open_output(output, lambda: click.get_text_stream("stdout")))
    watch = HeadWatch(client, timeout)  # while it follows: says when no head worker is live to run the jobs

    def write() -> tuple[list[JobView], int]:
        try:
            if not follow:
                return write_results(client, ids, out, skip, follow, timeout)
            with watch:
                return write_results(client, ids, out, skip, follow, timeout)
        except WaitTimeout as e:
            fail(f"{e}{watch.note()} (the lines of the requests that ended are written)", EXIT_TIMEOUT)
            raise

    try:
        views, n = run_guarded(write)
    finally:
        if output:
            out.close()
    left = sum(v.status not in FINAL for v in views)
    if output:
        click.echo(f"{n} lines written to {output}" + (f"; {left} requests not ended yet" if left else ""), err=True)
    return 0
