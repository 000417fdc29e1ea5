"""`shardflow plan`: how to split a model between a head and a tail on GPUs of given sizes, and what each
worker's memory will hold, from the checkpoint's config alone (no weights are read).

    shardflow plan --target Qwen/Qwen2.5-14B --gpus 15GiB,15GiB --draft Qwen/Qwen2.5-0.5B --quant 4bit
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

import click

from producer.options import (
    draft_quant_opt,
    dtype_opt,
    load_worker_plugins,
    plugins_opt,
    quant_opt,
    run_guarded,
    worker_settings,
)

if TYPE_CHECKING:
    from workers.engine.plan import Plan

UNITS = {"": 2**30, "gib": 2**30, "gb": 10**9, "mib": 2**20, "mb": 10**6, "tib": 2**40}


def parse_size(text: str) -> int:
    """'15GiB', '15 GB', '15000MiB' or '15' (GiB) in bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in UNITS or float(m.group(1)) <= 0:
        raise click.BadParameter(f"{text!r} is not a size like 15GiB, 16GB or 15000MiB")
    return int(float(m.group(1)) * UNITS[unit])


def parse_gpus(_ctx: click.Context, _param: click.Parameter, value: str) -> list[int]:
    sizes = [parse_size(s) for s in value.split(",") if s.strip()]
    if len(sizes) not in (2, 3):
        raise click.BadParameter("give 2 sizes (head, tail) or 3 (head, tail, the head's drafter)")
    return sizes


@click.command()
@click.option("--target", required=True, help="Target model: local directory or hub id (only its config is read).")
@click.option(
    "--gpus",
    required=True,
    callback=parse_gpus,
    help="Memory of the head's and the tail's GPU (and a third for the drafter), e.g. 15GiB,15GiB.",
)
@click.option("--draft", default=None, help="Draft model on the head (dir or hub id).")
@dtype_opt
@quant_opt
@draft_quant_opt
@click.option("--split", type=click.IntRange(1), default=None, help="Evaluate this split (the tail's first layer).")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@plugins_opt
def plan(
    target: str,
    gpus: list[int],
    draft: str | None,
    dtype: str | None,
    quant: str | None,
    draft_quant: str | None,
    split: int | None,
    as_json: bool,
    plugins: tuple[str, ...],
) -> None:
    """Print the split (head layers 0:S, tail S:L) that holds the most jobs in flight (or --split's), and each worker's
    expected memory: weights, KV cache slots, the total (the allocator's; add the CUDA context for
    nvidia-smi). Exits 2 if a worker cannot hold one full-length slot."""
    import torch

    from producer.options import EXIT_BAD_INPUT, fail
    from workers.engine.plan import plan_split

    registry = run_guarded(lambda: load_worker_plugins(plugins))
    config = run_guarded(lambda: registry.config(target))
    dconfig = run_guarded(lambda: registry.config(draft)) if draft else None
    settings = worker_settings(engine={"dtype": dtype, "quant": quant, "draft_quant": draft_quant})
    dtype, quant, draft_quant = settings.engine.dtype, settings.engine.quant, settings.engine.draft_quant
    dt = getattr(torch, dtype) if dtype != "auto" else getattr(config, "dtype", None) or torch.float32
    dt = getattr(torch, dt) if isinstance(dt, str) else dt
    if quant == "none":  # a checkpoint stored quantized is planned as stored
        from workers.engine.quant import prequantized_scheme

        quant = run_guarded(lambda: prequantized_scheme(config))
    result = run_guarded(
        lambda: plan_split(
            config,
            gpus,
            dtype=dt,
            quant=quant,
            draft=dconfig,
            draft_quant=draft_quant,
            settings=settings,
            name=str(target),
            split=split,
        )
    )
    click.echo(json.dumps(result.as_dict()) if as_json else render(result))
    if not all(w.slots for w in result.workers):
        fail("the model does not fit these GPUs", EXIT_BAD_INPUT)


def render(plan: Plan) -> str:
    """The plan as `shardflow plan` prints it."""
    from workers.engine.plan import gb

    lens = {w.short_len for w in plan.workers if w.short}
    each = ", ".join(f"{w.role} {w.short_len}" for w in plan.workers if w.short)
    short = f" + short ones of {lens.pop() if len(lens) == 1 else each}" if lens else ""
    lines = [
        f"{plan.model or 'model'}: {plan.dtype}, layers quantized {plan.quant}; slots of {plan.full_len} "
        f"positions{short}; {plan.in_flight} jobs in flight at most",
        f"{'worker':<7}{'budget GiB':>11}{'layers':>8}{'weights GiB':>12}{'slot MiB full/short':>20}"
        f"{'slots full+short':>17}{'KV GiB':>7}{'slots GiB':>10}{'expected GiB':>13}{'+ CUDA ctx':>11}",
    ]
    for w in plan.workers:
        a, b = w.layers
        slot = f"{w.full_slot / 2**20:.1f}/{w.short_slot / 2**20:.1f}"
        lines.append(
            f"{w.role:<7}{gb(w.budget):>11}{f'{a}:{b}':>8}{gb(w.weights):>12}{slot:>20}{f'{w.full}+{w.short}':>17}"
            f"{gb(w.kv):>7}{gb(w.caches):>10}{gb(w.expected):>13}{gb(w.expected + w.context):>11}"
        )
    if not all(w.slots for w in plan.workers):
        lines.append("does not fit: a worker has no room for one full-length slot (quantize, or use more memory)")
    return "\n".join(lines)
