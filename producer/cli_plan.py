"""`shardflow plan`: how to split a model between a head and a tail, or a head, middle stages and a tail, on GPUs
of given sizes, what each worker's memory will hold, from the checkpoint's config alone (no weights are read),
and for N stages each worker's command and the predicted tok/s of one job.

    shardflow plan --target Qwen/Qwen2.5-14B --gpus 15GiB,15GiB --draft Qwen/Qwen2.5-0.5B --quant 4bit
    shardflow plan --target Qwen/Qwen2.5-14B --draft Qwen/Qwen2.5-0.5B --dtype float16 --gpus 15GiB,15GiB,15GiB,15GiB
    shardflow plan ... --machines 15GiB+15GiB,15GiB+15GiB     # two machines of two GPUs: a worker may span them

Two or three --gpus (head, tail, and the drafter's own GPU) give the two-worker plan (`plan.plan_split`); four or
more, --machines, or --stages give the N-stage plan (workers/engine/plan_stages.py).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import click

from producer.options import run_guarded, worker_settings
from producer.worker_options import draft_quant_opt, dtype_opt, load_worker_plugins, plugins_opt, quant_opt

if TYPE_CHECKING:
    from workers.engine.plan import Plan, WorkerPlan
    from workers.engine.plan_stages import StagePlan, Stages

UNITS = {"": 2**30, "gib": 2**30, "gb": 10**9, "mib": 2**20, "mb": 10**6, "tib": 2**40}


def parse_size(text: str) -> int:
    """'15GiB', '15 GB', '15000MiB' or '15' (GiB) in bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in UNITS or float(m.group(1)) <= 0:
        raise click.BadParameter(f"{text!r} is not a size like 15GiB, 16GB or 15000MiB")
    return int(float(m.group(1)) * UNITS[unit])


def parse_gpus(_ctx: click.Context, _param: click.Parameter, value: str | None) -> list[int] | None:
    if value is None:
        return None
    sizes = [parse_size(s) for s in value.split(",") if s.strip()]
    if len(sizes) < 2:
        raise click.BadParameter("give 2 sizes (head, tail), 3 (head, tail, the head's drafter), or one a stage")
    return sizes


def parse_machines(_ctx: click.Context, _param: click.Parameter, value: str | None) -> list[list[int]] | None:
    """'15GiB+15GiB,15GiB+15GiB': machines split on ',', each machine's GPUs on '+'."""
    if value is None:
        return None
    return [[parse_size(g) for g in m.split("+")] for m in value.split(",") if m.strip()]


@click.command()
@click.option("--target", required=True, help="Target model: local directory or hub id (only its config is read).")
@click.option(
    "--gpus",
    callback=parse_gpus,
    help="Memory of each GPU, one machine each: 2 sizes (head, tail) or 3 (and the drafter's own), e.g. 15GiB,15GiB; "
    "4 or more, one worker a GPU (the N-stage plan, which tries fewer too).",
)
@click.option(
    "--machines",
    callback=parse_machines,
    help="Machines and their GPUs for the N-stage plan, e.g. 15GiB+15GiB,15GiB+15GiB: a machine's GPUs run one "
    "worker spanning them (--devices, no hop between them) or one worker each; the plan tries both.",
)
@click.option("--draft", default=None, help="Draft model on the head (dir or hub id).")
@dtype_opt
@quant_opt
@draft_quant_opt
@click.option("--split", type=click.IntRange(1), default=None, help="Evaluate this split (the tail's first layer).")
@click.option(
    "--stages",
    type=click.IntRange(2),
    default=None,
    help="N-stage plan with this many workers (said when fewer would be faster); --gpus then means one worker a GPU.",
)
@click.option("--jobs", type=click.IntRange(1), default=1, help="N-stage plan: the fewest jobs in flight to hold.")
@click.option("--alpha", type=click.FloatRange(0, 1), default=0.78, help="N-stage plan: draft acceptance assumed.")
@click.option("-k", "k", type=click.IntRange(0), default=None, help="N-stage plan: drafts a round [engine.graph_k].")
@click.option("--rtt-ms", type=click.FloatRange(0), default=86.0, help="N-stage plan: a hop's round trip, ms.")
@click.option(
    "--gpu-bandwidth-gbs", type=click.FloatRange(min=1), default=300.0, help="N-stage plan: a GPU's reads, GB/s (T4)."
)
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@plugins_opt
def plan(
    target: str,
    gpus: list[int] | None,
    machines: list[list[int]] | None,
    draft: str | None,
    dtype: str | None,
    quant: str | None,
    draft_quant: str | None,
    split: int | None,
    stages: int | None,
    jobs: int,
    alpha: float,
    k: int | None,
    rtt_ms: float,
    gpu_bandwidth_gbs: float,
    as_json: bool,
    plugins: tuple[str, ...],
) -> None:
    """Print the split (head layers 0:S, tail S:L) that holds the most jobs in flight (or --split's), and each worker's
    expected memory: weights, KV cache slots, the total (the allocator's; add the CUDA context for
    nvidia-smi). With 4+ GPUs, --machines or --stages: the N-stage plan, each worker's command and the predicted tok/s
    of one job for every layout, and whether fewer stages would be faster. Exits 2 if a worker cannot hold one
    full-length slot."""
    import torch

    from producer.options import EXIT_BAD_INPUT, fail
    from workers.engine.plan import plan_split

    if (gpus is None) == (machines is None):
        raise click.UsageError("give --gpus or --machines (one of them)")
    n_stage = machines is not None or stages is not None or len(gpus or []) > 3
    if n_stage and split is not None:
        raise click.UsageError("--split is for two workers; an N-stage plan takes --stages")
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
    if n_stage:
        from workers.engine.plan_stages import Timing, plan_stages
        from workers.speculative.adaptive import expected_tokens

        k = settings.engine.graph_k if k is None else k
        k = k if draft else 0
        timing = Timing(rtt_ms, gpu_bandwidth_gbs, expected_tokens(alpha, k), k)
        got: Stages = run_guarded(
            lambda: plan_stages(
                config,
                gpus if machines is None else None,
                dtype=dt,
                quant=quant,
                draft=dconfig,
                draft_quant=draft_quant,
                settings=settings,
                machines=machines,
                timing=timing,
                stages=stages,
                min_jobs=jobs,
                name=str(target),
            )
        )
        flags = Flags(target, draft, str(dt).removeprefix("torch."), quant, draft_quant, plugins)
        lines = commands(got.chosen, flags)
        out = json.dumps(got.as_dict() | {"commands": lines}) if as_json else render_stages(got, alpha, lines)
        click.echo(out)
        if not got.chosen.fits:
            fail("the model does not fit these GPUs", EXIT_BAD_INPUT)
        return
    assert gpus is not None
    if len(gpus) not in (2, 3):
        raise click.BadParameter("give 2 sizes (head, tail) or 3 (head, tail, the head's drafter)", param_hint="--gpus")
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


COLUMNS = (
    f"{'budget GiB':>11}{'layers':>8}{'weights GiB':>12}{'slot MiB full/short':>20}"
    f"{'slots full+short':>17}{'KV GiB':>7}{'slots GiB':>10}{'expected GiB':>13}{'+ CUDA ctx':>11}"
)


def memory_row(w: WorkerPlan) -> str:
    """A worker's (or one device's) memory, as the tables' columns after the first."""
    from workers.engine.plan import gb

    a, b = w.layers
    slot = f"{w.full_slot / 2**20:.1f}/{w.short_slot / 2**20:.1f}"
    return (
        f"{gb(w.budget):>11}{f'{a}:{b}':>8}{gb(w.weights):>12}{slot:>20}{f'{w.full}+{w.short}':>17}"
        f"{gb(w.kv):>7}{gb(w.caches):>10}{gb(w.expected):>13}{gb(w.expected + w.context):>11}"
    )


def slots_text(plan: Plan | StagePlan, workers: list[WorkerPlan]) -> str:
    """ "model: float16, layers quantized none; slots of 8192 positions + short ones of 2048"."""
    lens = {w.short_len for w in workers if w.short}
    each = ", ".join(f"{w.role} {w.short_len}" for w in workers if w.short)
    short = f" + short ones of {lens.pop() if len(lens) == 1 else each}" if lens else ""
    head = f"{plan.model or 'model'}: {plan.dtype}, layers quantized {plan.quant}"
    return f"{head}; slots of {plan.full_len} positions{short}"


def render(plan: Plan) -> str:
    """The plan as `shardflow plan` prints it."""
    lines = [
        f"{slots_text(plan, plan.workers)}; {plan.in_flight} jobs in flight at most",
        f"{'worker':<7}{COLUMNS}",
    ]
    lines += [f"{w.role:<7}{memory_row(w)}" for w in plan.workers]
    if not all(w.slots for w in plan.workers):
        lines.append("does not fit: a worker has no room for one full-length slot (quantize, or use more memory)")
    return "\n".join(lines)


@dataclass(frozen=True)
class Flags:
    """What every worker's command repeats: the target, the drafter (the head's), dtype, quantization, plugins."""

    target: str
    draft: str | None
    dtype: str
    quant: str
    draft_quant: str
    plugins: tuple[str, ...]


def commands(plan: StagePlan, flags: Flags) -> list[str]:
    """Each worker's `shardflow head|stage|tail` command, machine by machine (a comment line before each)."""
    out = []
    for w in plan.workers:
        a, b = w.layers
        verb = "head" if w.role == "head" else "tail" if w.role == "tail" else "stage"
        args = [f"shardflow {verb}", *(f"--plugin {p}" for p in flags.plugins), f"--target {flags.target}"]
        args.append(f"--layers {a}:{b}")
        devices = ",".join(f"cuda:{i}" for i in w.indices)
        if verb == "head" and flags.draft:
            args.append(f"--draft {flags.draft}")
        args.append(f"--devices {devices}" if len(w.indices) > 1 else f"--device {devices}")
        if verb == "head" and flags.draft and len(w.indices) > 1:
            args.append(f"--draft-device cuda:{w.indices[0]}")  # beside its first layers, as planned
        args.append(f"--dtype {flags.dtype}")
        if flags.quant != "none":
            args.append(f"--quant {flags.quant}")
        if verb == "head" and flags.draft and flags.draft_quant != "none":
            args.append(f"--draft-quant {flags.draft_quant}")
        args.append(f"--gpu-memory {math.floor(w.budget / 2**30 * 100) / 100:g}")
        out += [f"# machine {w.machine + 1}: {w.role}", " ".join(args)]
    return out


def render_stages(got: Stages, alpha: float, lines: list[str]) -> str:
    """The N-stage plan as `shardflow plan` prints it: every layout's prediction, the advice, the chosen layout's
    memory by device, and its workers' commands."""
    chosen, t = got.chosen, got.chosen.timing
    devices = [d for w in chosen.workers for d in w.devices]
    drafts = f"K={t.k} drafts at alpha {alpha:g}: {t.tokens_per_round:.2f} tokens a round" if t.k else "no drafter"
    out = [
        f"{slots_text(chosen, devices)}; {drafts}; a hop {t.rtt_ms:g} ms; a GPU reads {t.bandwidth_gbs:g} GB/s",
        f"{'stages':<7}{'GPUs':<10}{'jobs in flight':>15}{'compute ms':>11}{'round ms':>9}{'tok/s':>7}  layers",
    ]
    for o in got.options:
        ranges = " ".join(f"{a}:{b}" for a, b in (w.layers for w in o.workers))
        row = (
            f"{o.in_flight:>15}{o.compute_ms:>11.0f}{o.round_ms:>9.0f}{o.tok_s:>7.1f}" if o.fits else "   does not fit"
        )
        out.append(f"{o.hops:<7}{o.shape:<10}{row}  {ranges}")
    out += [got.advice, "", f"{'worker':<9}{'GPU':<11}{COLUMNS}"]
    for w in chosen.workers:
        gpus = zip(w.indices, w.devices, strict=True)
        out += [f"{w.role:<9}{f'{w.machine + 1}/cuda:{i}':<11}{memory_row(d)}" for i, d in gpus]
    out += ["", "Each worker's command (with its Redis: --redis-url or SHARDFLOW_REDIS__URL):", *lines]
    return "\n".join(out)
