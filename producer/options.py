"""What every `shardflow` command shares: exit codes, one-line failures (`fail`, `run_guarded`, the
`GuardedGroup` the `main` group of producer/cli.py is), option decorators, and turning options into
GenerationRequest fields and torch settings.

The command modules (producer/cli_admin.py, cli_jobs.py, cli_workers.py) import from here, never from
producer/cli.py, which imports them to register their commands: no module imports one that imports it.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

from schemas.errors import InvalidRequest, ModelLoadError, ShardFlowError, TransportError
from schemas.settings import Settings

if TYPE_CHECKING:
    import redis

    from producer.client import Client

EXIT_OK, EXIT_JOB_FAILED, EXIT_BAD_INPUT, EXIT_NOT_FOUND, EXIT_UNREACHABLE, EXIT_TIMEOUT = 0, 1, 2, 3, 4, 5


log = logging.getLogger("shardflow.cli")  # the CLI's logger, whichever module logs


def fail(message: str, code: int) -> None:
    """Print a one-line error (a multi-line message is joined with ' | ') and exit with `code`."""
    line = " | ".join(part.strip() for part in str(message).splitlines() if part.strip())
    click.echo(f"error: {line}", err=True)
    sys.exit(code)


def run_guarded(fn: Callable[[], Any]) -> Any:
    """Map ShardFlow errors, and any Redis error, to one-line messages and exit codes."""
    import redis

    from producer.client import NotFound

    try:
        return fn()
    except NotFound as e:
        fail(str(e), EXIT_NOT_FOUND)
    except (InvalidRequest, ModelLoadError) as e:
        fail(str(e), EXIT_BAD_INPUT)
    except TransportError as e:
        fail(str(e), EXIT_UNREACHABLE)
    except ShardFlowError as e:
        fail(str(e), EXIT_JOB_FAILED)
    except redis.exceptions.NoPermissionError as e:
        log.info("Redis refused a command", exc_info=True)
        fail(f"Redis refused: {e} (check the URL's user and its ACL)", EXIT_UNREACHABLE)
    except redis.exceptions.RedisError as e:
        log.info("Redis error", exc_info=True)
        fail(f"Redis: {type(e).__name__}: {e}", EXIT_UNREACHABLE)
    except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
        raise  # click's own usage errors and exits
    except Exception as e:  # a bug, or data nobody checked: still one line (-v logs the traceback)
        log.info("unexpected error", exc_info=True)
        fail(f"unexpected {type(e).__name__}: {e}", EXIT_JOB_FAILED)


class GuardedGroup(click.Group):
    """The `shardflow` group: every command runs under `run_guarded`, so no ShardFlow or Redis error
    escapes as a traceback (click's own usage errors and exits pass through untouched)."""

    def invoke(self, ctx: click.Context) -> Any:
        """Run the command `ctx` names under `run_guarded`."""
        return run_guarded(lambda: super(GuardedGroup, self).invoke(ctx))


def parse_layers(value: str) -> tuple[int, int]:
    """A:B (e.g. 0:14) as the pair (A, B), with 0 <= A < B; anything else is a click usage error."""
    try:
        a, b = (int(x) for x in value.split(":"))
    except ValueError:
        raise click.BadParameter(f"{value!r} is not A:B (e.g. 0:14)") from None
    if not 0 <= a < b:
        raise click.BadParameter(f"{value!r}: need 0 <= A < B")
    return a, b


def layers_option(help_text: str, envvar: str | None = None) -> Callable:
    """--layers A:B (required; also from `envvar` when given), parsed by `parse_layers`."""
    return click.option(
        "--layers",
        required=True,
        envvar=envvar,
        show_envvar=envvar is not None,
        callback=lambda c, p, v: parse_layers(v),
        help=help_text,
    )


def setting_default(group: str, name: str) -> dict[str, Any]:
    """click keywords of a flag that defaults to a setting: its value from the environment when the command runs
    (SHARDFLOW_GROUP__NAME; schemas/settings.py), else the documented default, which
    --help shows."""
    model = Settings.model_fields[group].annotation
    documented = model.model_fields[name].default  # type: ignore[union-attr]
    return {"default": lambda: getattr(getattr(worker_settings(), group), name), "show_default": str(documented)}


redis_opt = click.option(
    "--redis-url",
    **setting_default("redis", "url"),
    help="Redis to use: redis://, rediss:// (TLS) or unix://; user:password@ for ACL users [env SHARDFLOW_REDIS__URL].",
)
prefix_opt = click.option(
    "--prefix",
    **setting_default("redis", "prefix"),
    help="Namespace of ShardFlow's own Redis keys [env SHARDFLOW_REDIS__PREFIX].",
)
queue_opt = click.option(
    "--queue",
    **setting_default("jobs", "queue"),
    help="RQ queue of generation jobs [env SHARDFLOW_JOBS__QUEUE].",
)


class CliConfig:
    """A command's one configuration, built once and carried whole (as rq's CliConfig is): its flags by settings
    group (`CliConfig(redis={"url": url, "prefix": prefix}, jobs={"queue": queue})`; None = not given), the one
    `Settings` they make on top of the environment (`worker_settings`, built on first use), and the command's Redis
    connection and `Client`, opened from those settings on first use."""

    def __init__(self, **groups: dict[str, Any]) -> None:
        self.groups = groups
        self._redis: redis.Redis | None = None
        self._client: Client | None = None

    def with_flags(self, **groups: dict[str, Any]) -> CliConfig:
        """This configuration with more flags (a command's own, by group) on top; its settings not built yet."""
        merged = dict(self.groups)
        for group, flags in groups.items():
            merged[group] = {**merged.get(group, {}), **flags}
        return CliConfig(**merged)

    @functools.cached_property
    def settings(self) -> Settings:
        """SHARDFLOW_* from the environment with the flags on top (a usage error, exit 2, if either is wrong)."""
        return worker_settings(**self.groups)

    @property
    def redis_url(self) -> str:
        return self.settings.redis.url

    @property
    def prefix(self) -> str:
        return self.settings.redis.prefix

    @property
    def queue(self) -> str:
        return self.settings.jobs.queue

    def connect(self, **kwargs: Any) -> redis.Redis:
        """A new connection to the settings' Redis (relay_broker.connection.connect's keywords: `attempts`,
        `max_connections`)."""
        from relay_broker.connection import connect

        return run_guarded(lambda: connect(self.redis_url, settings=self.settings, **kwargs))

    @property
    def redis(self) -> redis.Redis:
        """The command's connection, opened on first use (3 attempts: a user is waiting)."""
        if self._redis is None:
            self._redis = self.connect(attempts=3)
        return self._redis

    @property
    def client(self) -> Client:
        """The command's `Client` on `redis`, with these settings (their prefix and queue), made on first use."""
        if self._client is None:
            from producer.client import Client

            self._client = run_guarded(lambda: Client(self.redis, settings=self.settings))
        return self._client


def connection_options(fn: Callable) -> Callable:
    """--queue, --redis-url and --prefix, shared by every command that talks to the job system; the command gets
    them as one `config: CliConfig` (rq's `pass_cli_config`)."""

    @functools.wraps(fn)
    def with_config(*args: Any, queue: str, redis_url: str, prefix: str, **kwargs: Any) -> Any:
        config = CliConfig(redis={"url": redis_url, "prefix": prefix}, jobs={"queue": queue})
        return fn(*args, config=config, **kwargs)

    return queue_opt(redis_opt(prefix_opt(with_config)))


timeout_opt = click.option(
    "--timeout",
    type=click.FloatRange(0, min_open=True),
    default=None,
    help="Give up waiting after this many seconds (exit 5).",
)


def _batch_id(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """--batch-id: what schemas.jobs.BATCH_ID_PATTERN allows (job ids BATCH-00000 are then valid RQ ids)."""
    import re

    from schemas.jobs import BATCH_ID_PATTERN

    if value is not None and not re.fullmatch(BATCH_ID_PATTERN, value):
        raise click.BadParameter(f"{value!r}: use 1-64 letters, digits, '_' or '-'")
    return value


def _result_ttl(ctx: click.Context, param: click.Parameter, value: int) -> int:
    """--result-ttl: at least 1 second."""
    if value < 1:
        raise click.BadParameter(f"{value}: results must be kept at least 1 second")
    return value


def batch_options(fn: Callable) -> Callable:
    """--batch-id, --result-ttl and --retries of `shardflow enqueue`, checked at parse time."""
    fn = click.option(
        "--retries",
        type=click.IntRange(0),
        **setting_default("jobs", "retries"),
        help="Automatic retries after a transient failure.",
    )(fn)
    fn = click.option(
        "--result-ttl",
        type=int,
        callback=_result_ttl,
        **setting_default("jobs", "result_ttl_s"),
        help="Seconds results are kept (at least 1).",
    )(fn)
    return click.option(
        "--batch-id",
        default=None,
        callback=_batch_id,
        help="Batch id: 1-64 letters, digits, '_' or '-' (default: time + random); job ids are BATCH-00000, ...",
    )(fn)


_ENV_SETTINGS = "shardflow.env_settings"  # where a command's context (ctx.meta, shared by it and its group) keeps them


def _read_environment() -> Settings:
    """SHARDFLOW_* from the environment, read once per command: kept in the running command's click context (every
    flag default and `worker_settings` of one command line share it); outside a command, read each time."""
    ctx = click.get_current_context(silent=True)
    if ctx is not None and _ENV_SETTINGS in ctx.meta:
        return ctx.meta[_ENV_SETTINGS]
    settings = Settings()  # a pydantic ValidationError if the environment is wrong: not kept
    if ctx is not None:
        ctx.meta[_ENV_SETTINGS] = settings
    return settings


def worker_settings(**groups: dict[str, Any]) -> Settings:
    """The one `Settings` a command runs with and passes down whole: SHARDFLOW_* from the environment, then the
    flags given on top, by group (`worker_settings(engine={"slots": slots, "device": device})`; None = not
    given). A setting the environment or a flag gets wrong is a usage error (exit 2). The environment is read
    once per command (`_read_environment`); the flags go on top of it (`_on_top`)."""
    from pydantic import ValidationError

    given = {g: {k: v for k, v in flags.items() if v is not None} for g, flags in groups.items()}
    given = {g: flags for g, flags in given.items() if flags}
    try:
        try:
            return _on_top(_read_environment(), given)
        except ValidationError:  # said as Settings says it (a flag may also mend what the environment got wrong)
            return Settings(**given)
    except ValidationError as e:
        from producer.reasons import plain_reason

        raise click.UsageError(f"settings: {plain_reason(e)}") from None


def _on_top(base: Settings, given: dict[str, dict[str, Any]]) -> Settings:
    """`base` with the flags `given` (by group) on top, each changed group validated whole, as `Settings.replace`
    does, without building a `Settings` again (that would read the environment again: pydantic-settings' __init__)."""
    changed = {}
    for group, flags in given.items():
        current = getattr(base, group)
        changed[group] = type(current).model_validate({**current.model_dump(), **flags})
    return base.model_copy(update=changed) if changed else base


def generation_options(fn: Callable) -> Callable:
    """Options shared by every command that builds GenerationRequests."""
    for opt in reversed(
        [
            click.option(
                "--max-new-tokens",
                type=click.IntRange(1, 1 << 20),
                **setting_default("generation", "max_new_tokens"),
                help="Tokens to generate at most.",
            ),
            click.option(
                "--temperature", type=click.FloatRange(0, 100), default=0.0, show_default=True, help="0 = greedy."
            ),
            click.option(
                "--top-p",
                type=click.FloatRange(0, 1, min_open=True),
                default=1.0,
                show_default=True,
                help="Nucleus mass kept, in (0, 1].",
            ),
            click.option(
                "--top-k", type=click.IntRange(0), default=0, show_default=True, help="Top tokens kept; 0 = off."
            ),
            click.option(
                "--seed", type=click.IntRange(0, (1 << 63) - 1), default=None, help="Seed for reproducible sampling."
            ),
            click.option(
                "--stop",
                multiple=True,
                help="Stop string (repeatable): the result's text keeps it; --format openai and serve leave it out.",
            ),
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
                type=click.IntRange(0, 64),
                **setting_default("generation", "draft_k"),
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
