"""The options of the worker commands (`shardflow head`, `stage`, `tail`: producer/cli_workers.py; `shardflow plan`):
where and how a worker runs its shard (device or devices, dtype, quantization, threads, static caches and graphs,
memory) and the plugins it loads, and applying the torch settings before anything loads. What every command
shares (connection options, one-line failures, `worker_settings`) is producer/options.py's."""

from __future__ import annotations

from collections.abc import Callable

import click

from schemas.settings import Settings

device_opt = click.option(
    "--device", default=None, help="Torch device, e.g. cpu, cuda:0 [default: cpu; env SHARDFLOW_ENGINE__DEVICE]."
)


def _devices(ctx: click.Context, param: click.Parameter, value: str | None) -> list[str] | None:
    if value is None:
        return None
    devices = [d.strip() for d in value.split(",") if d.strip()]
    if len(devices) < 2:
        raise click.BadParameter("name at least two devices, comma-separated (one device: --device)")
    return devices


devices_opt = click.option(
    "--devices",
    default=None,
    callback=_devices,
    help="Devices of this machine to spread the worker's layers over, in order, comma-separated (e.g. cuda:0,cuda:1: "
    "one worker, no Redis between them; each device about the same bytes of weights) [env SHARDFLOW_ENGINE__DEVICES, "
    "JSON].",
)


def device_flags(device: str | None, devices: list[str] | None) -> dict[str, object]:
    """--device and --devices as engine settings: with --devices, device is their first (another: a usage error)."""
    if devices and device not in (None, devices[0]):
        raise click.BadParameter(f"--device {device} is not the first of --devices {','.join(devices)}")
    return {"device": devices[0] if devices else device, "devices": devices}


dtype_opt = click.option(
    "--dtype",
    type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
    default=None,
    help="Weight dtype; auto = the checkpoint's [default: auto].",
)
quant_opt = click.option(
    "--quant",
    type=click.Choice(["none", "int8", "4bit"]),
    default=None,
    help="Weight-only quantization of the shard's layers (bitsandbytes: int8, or 4-bit NF4); a checkpoint "
    "saved quantized loads as stored [default: none; env SHARDFLOW_ENGINE__QUANT].",
)
draft_quant_opt = click.option(
    "--draft-quant",
    type=click.Choice(["none", "int8", "4bit"]),
    default=None,
    help="Weight-only quantization of the draft model's layers [default: none].",
)
threads_opt = click.option(
    "--threads", type=click.IntRange(1), default=None, help="CPU threads for torch (default: torch's)."
)


plugins_opt = click.option(
    "--plugin",
    "plugins",
    multiple=True,
    envvar="SHARDFLOW_PLUGINS",
    show_envvar=True,
    help="Module whose register(registry) adds drafter kinds or model schemes (workers/plugins.py); repeatable, "
    "or comma-separated in the environment. Benchmarks: bench.synthetic. None by default.",
)


def load_worker_plugins(plugins: tuple[str, ...]):
    """The registry of the --plugin modules (names split on commas too)."""
    from workers.plugins import load_plugins

    return load_plugins([m.strip() for p in plugins for m in p.split(",") if m.strip()])


def engine_options(fn: Callable) -> Callable:
    """--static-cache / --graphs / --slots / --max-len / --gpu-memory: how shards run (default: static caches, +
    graphs on CUDA)."""
    fn = click.option(
        "--max-len",
        type=click.IntRange(1),
        default=None,
        help="Positions a full-length static cache slot holds: the longest prompt + new tokens a worker takes "
        "(default: min(context, 8192)).",
    )(fn)
    fn = click.option(
        "--slots",
        type=click.IntRange(1),
        default=None,
        help="Sequences the static caches hold, run as one batched forward (default: what --gpu-memory leaves "
        "room for on a CUDA device, up to max_slots; 16 on a CPU).",
    )(fn)
    fn = click.option(
        "--gpu-memory",
        type=click.FloatRange(0, min_open=True),
        default=None,
        help="What the worker may fill of its GPU: a share (up to 1) or GiB (default: 0.9; lower it when workers "
        "share a GPU) [env SHARDFLOW_ENGINE__GPU_MEMORY].",
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
        help="Preallocated KV caches rolled back in place, run batched (the default), or growing ones, run one "
        "sequence at a time.",
    )(fn)


def torch_setup(settings: Settings) -> None:
    """Apply settings.engine.threads (on a CUDA device, default engine.cuda_torch_threads: a GPU worker's host
    work is small, and torch's pool would otherwise hold a thread per core) and engine.switch_interval_ms; before
    CUDA starts, let its allocator grow segments in place (less fragmentation under a worker's --gpu-memory cap)
    unless PYTORCH_CUDA_ALLOC_CONF says otherwise."""
    import os
    import sys

    import torch

    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

    engine, threads = settings.engine, settings.engine.threads
    if threads is None and engine.device.startswith("cuda"):
        threads = min(engine.cuda_torch_threads, os.cpu_count() or 1)
    if threads:
        torch.set_num_threads(threads)
    if engine.switch_interval_ms is not None:
        sys.setswitchinterval(engine.switch_interval_ms / 1000)
