"""Producer commands: `shardflow enqueue`, `status`, `results`, `retry`, `cancel`, `info`."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import click

from producer.cli_watch import follow_text, show_wait
from producer.client import Client, JobView, summary
from producer.options import (
    EXIT_BAD_INPUT,
    EXIT_JOB_FAILED,
    EXIT_OK,
    CliConfig,
    batch_options,
    connection_options,
    fail,
    generation_options,
    request_defaults,
    run_guarded,
    timeout_opt,
)

json_opt = click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON output.")


def _context_errors(client: Client, parsed) -> list[str]:
    """Check each prompt against the model its head workers announced (context length, vocabulary)."""
    info = client.model_info()
    if info is None:
        return []
    try:
        from transformers import AutoTokenizer

        from workers.head.prompts import encode_prompt

        tok = AutoTokenizer.from_pretrained(info.target)
    except Exception as e:  # tokenizer not reachable from here: the head worker checks instead
        click.echo(
            f"warning: cannot load {info.target}'s tokenizer here ({type(e).__name__}); "
            "prompt lengths are checked by the head worker",
            err=True,
        )
        return []
    errors = []
    for where, req in zip(parsed.sources, parsed.requests, strict=True):
        try:
            encode_prompt(tok, req, info.vocab_size, info.context_length)
        except Exception as e:
            errors.append(f"{where}: {e}")
    return errors


def _exit_for(views: list[JobView]) -> int:
    return EXIT_JOB_FAILED if any(v.status in ("failed", "canceled", "stopped") for v in views) else EXIT_OK


def _print_views(views: list[JobView], as_jsonl: bool, out=None) -> None:
    for v in views:
        if as_jsonl:
            click.echo(json.dumps(v.as_dict()), file=out)
        elif v.result is not None:
            click.echo(f"[{v.index}] {v.prompt}\n{v.result['text']}\n", file=out)
        else:
            click.echo(f"[{v.index}] {v.prompt}\n({v.status}{': ' + v.error if v.error else ''})\n", file=out)


@click.command()
@click.argument("prompts", nargs=-1)
@click.option(
    "-f",
    "--file",
    "file",
    default=None,
    help="Prompts file: one per line, or JSONL (one request per "
    "line: prompt or messages, plus any generation field); - reads stdin.",
)
@generation_options
@batch_options
@click.option("--wait", is_flag=True, help="Block until every job is done, with a progress bar; print results.")
@timeout_opt
@json_opt
@connection_options
def enqueue(
    prompts: tuple[str, ...],
    file: str | None,
    batch_id: str | None,
    result_ttl: int,
    retries: int,
    wait: bool,
    timeout: float | None,
    as_json: bool,
    config: CliConfig,
    **gen: object,
) -> None:
    """Enqueue one generation job per prompt under one batch; prints the batch id."""
    from producer.inputs import read_prompts

    defaults = request_defaults(**gen)  # type: ignore[arg-type]
    parsed = run_guarded(lambda: read_prompts(list(prompts), file, defaults, config.settings.generation))
    client = config.client if not parsed.errors else None
    errors = parsed.errors or _context_errors(client, parsed)  # type: ignore[arg-type]
    if errors:
        for e in errors:
            click.echo(f"error: {e}", err=True)
        sys.exit(EXIT_BAD_INPUT)
    batch = run_guarded(
        lambda: client.enqueue(
            parsed.requests,
            batch_id=batch_id,
            result_ttl=result_ttl,  # type: ignore[union-attr]
            retries=retries,
            tags=parsed.tags if any(parsed.tags) else None,
        )
    )
    if not wait:
        click.echo(
            json.dumps({"batch_id": batch.batch_id, "queue": batch.queue, "job_ids": batch.job_ids})
            if as_json
            else batch.batch_id
        )
        return
    click.echo(f"batch {batch.batch_id}: {len(batch.job_ids)} jobs", err=True)
    views = show_wait(client, batch.job_ids, timeout)  # type: ignore[arg-type]
    if as_json:
        click.echo(json.dumps({"batch_id": batch.batch_id, "jobs": [v.as_dict() for v in views]}))
    else:
        _print_views(views, as_jsonl=False)
    sys.exit(_exit_for(views))


@click.command()
@click.argument("target", required=False)
@json_opt
@connection_options
def status(target: str | None, as_json: bool, config: CliConfig) -> None:
    """Counts per state and per-job progress of a batch or job (no argument: the queue)."""
    client = config.client
    if target is None:
        info = run_guarded(client.info)
        click.echo(
            json.dumps(info)
            if as_json
            else "\n".join(
                f"{q['queue']}: {q['queued']} queued, {q['started']} started, {q['finished']} finished, "
                f"{q['failed']} failed, {q['canceled']} canceled, {q['workers']} workers"
                for q in info["queues"]
            )
            or "no queues"
        )
        return
    views = client.views(run_guarded(lambda: client.resolve(target)))
    if as_json:
        counts = Counter(v.status for v in views)
        click.echo(json.dumps({"target": target, "counts": counts, "jobs": [v.as_dict() for v in views]}))
        return
    click.echo(f"{target}: {summary(views)}")
    for v in views:
        p = v.progress
        speed = (
            f" {p.get('tokens', 0)} tokens, {p.get('tokens_per_s', 0):.1f} tok/s, "
            f"{p.get('tokens_per_round', 0):.2f} tok/round"
            if p
            else ""
        )
        click.echo(f"  [{v.index}] {v.job_id} {v.status}{speed}{': ' + v.error if v.error else ''}  {v.prompt}")


@click.command()
@click.argument("batch")
@click.option("--wait", is_flag=True, help="Wait for every job (progress bar), then print.")
@click.option("--follow", is_flag=True, help="Stream the text of running jobs as it commits.")
@click.option("--jsonl", is_flag=True, help="One JSON object per job.")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["shardflow", "openai"]),
    default="shardflow",
    show_default=True,
    help="openai: Batch API output lines of the requests that ended (with --follow: as they end, in that "
    "order; a stop sequence that ended a request is left out of its text, OpenAI's rule); with -o, a file that "
    "already holds some gets only the rest.",
)
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, writable=True),
    default=None,
    help="Write the results to this file instead of stdout.",
)
@timeout_opt
@connection_options
def results(
    batch: str,
    wait: bool,
    follow: bool,
    jsonl: bool,
    fmt: str,
    output: str | None,
    timeout: float | None,
    config: CliConfig,
) -> None:
    """Results of a batch (or one job): text, token counts, finish reason, timings. A generation a stop string
    ended keeps it: its text and token ids run through the token that completed it (--format openai and
    `shardflow serve` leave it out, as OpenAI does)."""
    client = config.client
    ids = run_guarded(lambda: client.resolve(batch))
    if fmt == "openai":
        from producer.openai_out import results_command

        sys.exit(results_command(client, ids, output, follow or wait, timeout))
    true_text = True
    if follow:
        views, true_text = follow_text(client, ids, timeout)
    elif wait:
        views = show_wait(client, ids, timeout)
    else:
        views = client.views(ids)
    if output:
        try:
            with Path(output).open("w", encoding="utf-8") as f:
                _print_views(views, jsonl or output.endswith(".jsonl"), out=f)
        except OSError as e:
            fail(f"cannot write {output}: {e.strerror or e}", EXIT_BAD_INPUT)
    elif not follow or jsonl:
        _print_views(views, jsonl)
    sys.exit(_exit_for(views) if true_text else EXIT_JOB_FAILED)


@click.command()
@click.argument("target", required=False)
@click.option("--failed", "all_failed", is_flag=True, help="Every failed job of the queue.")
@click.option("--wait", is_flag=True, help="Wait for the retried jobs to finish.")
@timeout_opt
@connection_options
def retry(target: str | None, all_failed: bool, wait: bool, timeout: float | None, config: CliConfig) -> None:
    """Re-enqueue failed generations of a batch or job (or --failed: all), keeping ids and batch."""
    if (target is None) == (not all_failed):
        fail("give a BATCH or JOB id, or --failed", EXIT_BAD_INPUT)
    client = config.client
    ids = client.failed_job_ids() if all_failed else run_guarded(lambda: client.resolve(target))  # type: ignore[arg-type]
    done = client.retry(ids)
    click.echo(f"re-enqueued {len(done)} job(s)", err=True)
    for jid in done:
        click.echo(jid)
    if wait and done:
        sys.exit(_exit_for(show_wait(client, done, timeout)))


@click.command()
@click.argument("target")
@connection_options
def cancel(target: str, config: CliConfig) -> None:
    """Cancel a batch's or a job's unfinished generations."""
    client = config.client
    done = client.cancel(run_guarded(lambda: client.resolve(target)))
    click.echo(f"cancelled {len(done)} job(s)")


@click.command()
@json_opt
@connection_options
def info(as_json: bool, config: CliConfig) -> None:
    """The queue (--queue): its jobs per state, the workers that serve it, and the model its heads announced."""
    data = run_guarded(config.client.info)
    if as_json:
        click.echo(json.dumps(data))
        return
    for q in data["queues"]:
        click.echo(
            f"queue {q['queue']}: {q['queued']} queued, {q['started']} started, {q['scheduled']} scheduled, "
            f"{q['finished']} finished, {q['failed']} failed, {q['canceled']} canceled; {q['workers']} workers"
        )
    for w in data["workers"]:
        click.echo(f"worker {w['name']}: {w['state']} on {', '.join(w['queues'])}")
    if not data["workers"]:
        click.echo(f"no worker serves queue {config.queue}")
    if data["model"]:
        m = data["model"]
        click.echo(f"model {m['target']} (context {m['context_length']}, head layers {m['head_layers']})")
