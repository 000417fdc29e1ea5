"""Operator commands: `shardflow dead-letters` lists (and optionally clears) the packets tails refused.

shardflow dead-letters --redis-url redis://admin:PASSWORD@host:6379/0 [--count 50] [--json] [--clear]
"""

from __future__ import annotations

import json
import time

import click

from producer.options import prefix_opt, redis_opt, run_guarded
from schemas.keys import Keys


@click.command("dead-letters")
@click.option("--count", type=click.IntRange(1), default=50, show_default=True, help="Newest entries to show.")
@click.option("--json", "as_json", is_flag=True, help="One JSON record per line.")
@click.option("--clear", is_flag=True, help="Delete the dead-letter stream after listing it.")
@redis_opt
@prefix_opt
def dead_letters(count: int, as_json: bool, clear: bool, redis_url: str, prefix: str) -> None:
    """List packets tails refused (malformed, oversized, wrong version, duplicate, failed), newest first."""
    from relay_broker.connection import connect
    from schemas.packets import HEADER, DeadLetterRecord  # imports torch: only when the command runs

    r = run_guarded(lambda: connect(redis_url, attempts=3))
    stream = Keys(prefix).dead_letters
    total = run_guarded(lambda: r.xlen(stream))
    entries = run_guarded(lambda: r.xrevrange(stream, count=count))
    for entry_id, fields in entries:
        try:
            rec = DeadLetterRecord.model_validate_json(fields[HEADER])
        except Exception as e:
            click.echo(f"{entry_id.decode()}  (unreadable record: {e})")
            continue
        if as_json:
            click.echo(json.dumps(rec.model_dump(mode="json")))
            continue
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rec.at))
        where = f"session {rec.session_id} round {rec.round_id}" if rec.session_id else "no session"
        who = f"tail {rec.tail_id or '?'}" if rec.refused_by == "tail" else "head"
        click.echo(f"{when}  {who}  {where}: {rec.reason}")
    if not as_json:
        shown = f", newest {len(entries)} shown" if total else ""
        click.echo(f"{total} dead letter(s) in {stream}{shown}", err=True)
    if clear:
        run_guarded(lambda: r.delete(stream))
        click.echo(f"cleared {stream}", err=True)
