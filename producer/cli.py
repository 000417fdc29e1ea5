"""`shardflow`: the command line of ShardFlow.

Workers:   shardflow tail | head | redis          (producer/cli_workers.py)
Jobs:      shardflow enqueue | status | results | retry | cancel | info   (producer/cli_jobs.py)
Operators: shardflow dead-letters                 (producer/cli_admin.py)
One-shot:  shardflow generate | local | demo

Every option has --help; defaults come from schemas/settings.py (environment: SHARDFLOW_*).
Exit codes: 0 ok; 1 a job failed or was cancelled; 2 bad usage or invalid input (nothing enqueued);
3 unknown batch or job; 4 Redis unreachable; 5 timed out waiting.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

import click

from schemas.errors import InvalidRequest, ShardFlowError, TransportError
from schemas.settings import DEFAULTS

EXIT_OK, EXIT_JOB_FAILED, EXIT_BAD_INPUT, EXIT_NOT_FOUND, EXIT_UNREACHABLE, EXIT_TIMEOUT = 0, 1, 2, 3, 4, 5


def fail(message: str, code: int) -> None:
    """Print a one-line error and exit with `code`."""
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def run_guarded(fn: Callable[[], Any]) -> Any:
    """Map ShardFlow errors to one-line messages and exit codes."""
    from producer.client import NotFound

    try:
        return fn()
    except NotFound as e:
        fail(str(e), EXIT_NOT_FOUND)
    except InvalidRequest as e:
        fail(str(e), EXIT_BAD_INPUT)
    except TransportError as e:
        fail(str(e), EXIT_UNREACHABLE)
    except ShardFlowError as e:
        fail(str(e), EXIT_JOB_FAILED)


def parse_layers(value: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in value.split(":"))
    except ValueError:
        raise click.BadParameter(f"{value!r} is not A:B (e.g. 0:14)") from None
    if not 0 <= a < b:
        raise click.BadParameter(f"{value!r}: need 0 <= A < B")
    return a, b


def layers_option(help_text: str) -> Callable:
    return click.option("--layers", required=True, callback=lambda c, p, v: parse_layers(v), help=help_text)


redis_opt = click.option(
    "--redis-url",
    default=DEFAULTS.redis_url,
    show_default=True,
    help="Redis to use: redis://, rediss:// (TLS) or unix://; user:password@ for ACL users [env SHARDFLOW_REDIS_URL].",
)
prefix_opt = click.option(
    "--prefix",
    default=DEFAULTS.prefix,
    show_default=True,
    help="Namespace of ShardFlow's own Redis keys [env SHARDFLOW_PREFIX].",
)
queue_opt = click.option(
    "--queue", default=DEFAULTS.queue, show_default=True, help="RQ queue of generation jobs [env SHARDFLOW_QUEUE]."
)


def connection_options(fn: Callable) -> Callable:
    """--queue, --redis-url and --prefix, shared by every command that talks to the job system."""
    return queue_opt(redis_opt(prefix_opt(fn)))


device_opt = click.option("--device", default="cpu", show_default=True, help="Torch device, e.g. cpu, cuda:0.")
dtype_opt = click.option(
    "--dtype",
    type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
    default="auto",
    show_default=True,
    help="Weight dtype; auto = the checkpoint's.",
)
threads_opt = click.option("--threads", type=int, default=None, help="CPU threads for torch (default: torch's).")


def engine_options(fn: Callable) -> Callable:
    """--static-cache / --graphs / --slots: how shards run (default: static + graphs on CUDA, off on CPU)."""
    fn = click.option(
        "--slots",
        type=click.IntRange(1),
        default=DEFAULTS.batch_slots,
        show_default=True,
        help="Sequences run as one batched forward (static caches are preallocated for this many).",
    )(fn)
    fn = click.option(
        "--graphs/--no-graphs",
        default=None,
        help="Replay each round's forward as a CUDA graph (needs a static cache; CUDA only).",
    )(fn)
    return click.option(
        "--static-cache/--dynamic-cache",
        "static",
        default=None,
        help="Preallocated KV caches rolled back in place, instead of growing ones.",
    )(fn)


def torch_setup(threads: int | None, dtype: str | None) -> Any:
    """Apply --threads and turn --dtype into a torch dtype (None = the checkpoint's)."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    return None if dtype in (None, "auto") else getattr(torch, dtype)


def generation_options(fn: Callable) -> Callable:
    """Options shared by every command that builds GenerationRequests."""
    for opt in reversed(
        [
            click.option(
                "--max-new-tokens",
                type=int,
                default=DEFAULTS.max_new_tokens,
                show_default=True,
                help="Tokens to generate at most.",
            ),
            click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy."),
            click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus mass kept, in (0, 1]."),
            click.option("--top-k", type=int, default=0, show_default=True, help="Top tokens kept; 0 = off."),
            click.option("--seed", type=int, default=None, help="Seed for reproducible sampling."),
            click.option("--stop", multiple=True, help="Stop string (repeatable)."),
            click.option(
                "--drafter",
                "draft_kind",
                type=click.Choice(["model", "ngram", "none"]),
                default="model",
                show_default=True,
                help="Drafter: the head's draft model (n-gram if it has none), n-gram, none.",
            ),
            click.option(
                "-k",
                "--draft-k",
                "k",
                type=int,
                default=DEFAULTS.draft_k,
                show_default=True,
                help="Draft tokens per round.",
            ),
            click.option(
                "--chat-template/--no-chat-template",
                default=None,
                help="Wrap prompts in the tokenizer's chat template (default: if it has one).",
            ),
        ]
    ):
        fn = opt(fn)
    return fn


def request_defaults(
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int | None,
    stop: tuple[str, ...],
    draft_kind: str,
    k: int,
    chat_template: bool | None,
) -> dict:
    """GenerationRequest fields from the generation options (before per-prompt fields)."""
    out: dict = {
        "max_new_tokens": max_new_tokens,
        "stop": list(stop),
        "chat_template": chat_template,
        "sampling": {"temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed},
        "draft": {"kind": draft_kind, "k": k},
    }
    return out


@click.group()
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
def main(verbose: int) -> None:
    """ShardFlow: split-model LLM inference over Redis with lossless speculative decoding."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


from producer import cli_admin, cli_jobs, cli_workers  # noqa: E402,F401  (registers the commands)
