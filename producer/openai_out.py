"""Results in OpenAI's Batch API output format: one line per request that ended, `{"id", "custom_id",
"response": {"status_code", "request_id", "body"}, "error"}` (schemas/openai.py), written as jobs end.

    shardflow results BATCH --format openai -o out.jsonl --follow

Lines come in completion order (join on custom_id); each is flushed as it is written, so an interrupted run
keeps what it wrote, and a run given the same file appends only the requests not yet in it (a torn last
line is cut first). Jobs enqueued without a Batch API line get their job id as custom_id.
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


def line_for(view: JobView) -> dict:
    """The output line of a job that ended."""
    tag = JobTag.model_validate(view.openai) if view.openai else JobTag()
    if tag.custom_id is None:
        tag = tag.model_copy(update={"custom_id": view.job_id})
    ok = view.status == "finished" and view.result is not None
    return output_line(tag, view.job_id, view.result if ok else None, None if ok else view.error or view.status)


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
    """Appends the lines of jobs as they end, once each."""

    def __init__(self, out: IO[str], skip: set[str]) -> None:
        self.out, self.done = out, set(skip)
        self.written = 0

    def __call__(self, views: list[JobView]) -> None:
        for v in sorted((v for v in views if v.status in FINAL), key=lambda v: v.index):
            line = line_for(v)
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
    writer = Writer(out, skip)
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

    from producer.options import EXIT_TIMEOUT, fail, run_guarded

    out, skip = run_guarded(lambda: open_output(output, lambda: click.get_text_stream("stdout")))

    def write() -> tuple[list[JobView], int]:
        try:
            return write_results(client, ids, out, skip, follow, timeout)
        except WaitTimeout as e:
            fail(f"{e} (the lines of the requests that ended are written)", EXIT_TIMEOUT)
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
