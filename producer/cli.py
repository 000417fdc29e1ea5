"""`shardflow`: the command line of ShardFlow.

Workers:   shardflow tail | stage | head          (producer/cli_workers.py)
Jobs:      shardflow enqueue | status | results | retry | cancel | info   (producer/cli_jobs.py)
Operators: shardflow dead-letters | redis         (producer/cli_admin.py)
One-shot:  shardflow generate | local | demo
Planning:  shardflow plan                         (producer/cli_plan.py)
Checking:  shardflow doctor                       (producer/cli_doctor.py: the link and Redis, from any role)
HTTP:      shardflow serve (OpenAI-compatible)     (producer/cli_serve.py, producer/api.py)

Every option has --help; defaults come from schemas/settings.py (environment: SHARDFLOW_*).
Exit codes: 0 ok; 1 a job failed or was cancelled; 2 bad usage or invalid input (nothing enqueued; a
model that cannot be loaded too); 3 unknown batch or job; 4 Redis unreachable or refusing (bad URL, wrong
credentials, no permission for a command under its ACL, DB index out of range, port taken by
`shardflow redis`); 5 timed out waiting.
Every failure is one line on stderr (`error: ...`), never a traceback; -v also logs the traceback of a
Redis error.

This module only builds the `main` group and registers the commands. The command modules define plain
`click.command`s and import what they share (exit codes, `fail`, `run_guarded`, option decorators) from
producer/options.py, never from here, so no module of `producer` imports one that imports it
(`lint-imports` checks).
"""

from __future__ import annotations

import os

# numpy's OpenBLAS starts a thread per core when it is imported (15 idle threads in each worker on a 16-core
# GPU machine); ShardFlow's numpy use is byte copies, and its CPU math is torch's (its pool: --threads). The
# environment, if it says, wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import logging

import click

from producer import cli_admin, cli_doctor, cli_jobs, cli_plan, cli_serve, cli_workers
from producer.options import GuardedGroup


@click.group(cls=GuardedGroup)
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
def main(verbose: int) -> None:
    """ShardFlow: split-model LLM inference over Redis with lossless speculative decoding."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


COMMANDS: tuple[click.Command, ...] = (
    cli_admin.dead_letters,  # "dead-letters"
    cli_jobs.enqueue,
    cli_jobs.status,
    cli_jobs.results,
    cli_jobs.retry,
    cli_jobs.cancel,
    cli_jobs.info,
    cli_admin.redis,
    cli_doctor.doctor,
    cli_workers.tail,
    cli_workers.stage,
    cli_workers.head,
    cli_workers.generate,
    cli_workers.local,
    cli_workers.demo,
    cli_plan.plan,
    cli_serve.serve,
)
for _command in COMMANDS:
    main.add_command(_command)
