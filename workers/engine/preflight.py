"""A worker's memory check before it loads anything: refuse a budget its models cannot fit, with the numbers,
and cap its CUDA allocator at the budget (workers/engine/plan.py). `shardflow tail` and `shardflow head`
(producer/cli_workers.py) call `preflight_tail` / `preflight_head` with the settings they will run with."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from transformers import PretrainedConfig

from schemas.settings import Settings
from workers.engine.chain import device_ranges, whole_bytes
from workers.engine.plan import Part, check_worker, enforce_budget
from workers.engine.quant import prequantized_scheme


class Configs(Protocol):
    """What the check needs of a plugin registry (workers/plugins.py): a target's config, no weights."""

    def config(self, target: str | Path) -> PretrainedConfig: ...


@dataclass(frozen=True)
class Load:
    """One model a worker will load: which layers (None: all), whether its embedding and its LM head, quantized how."""

    target: str
    layers: tuple[int, int] | None
    embed: bool
    head: bool
    quant: str = "none"


def preflight(role: str, registry: Configs, loads: list[Load], device: str, settings: Settings) -> None:
    """Before a worker on `device` loads `loads` (in settings.engine.dtype): refuse (ModelLoadError) a budget they
    and one full-length cache slot cannot fit, then cap the CUDA allocator at the budget."""
    dtype = None if settings.engine.dtype == "auto" else getattr(torch, settings.engine.dtype)

    def part(load: Load) -> Part:
        cfg = registry.config(load.target)
        quant = load.quant if load.quant != "none" else prequantized_scheme(cfg)  # a checkpoint stored quantized
        dt = dtype or getattr(cfg, "dtype", None) or torch.float32
        dt = getattr(torch, dt) if isinstance(dt, str) else dt
        return Part(cfg, tuple(load.layers or (0, cfg.num_hidden_layers)), load.embed, load.head, dt, quant)  # type: ignore[arg-type]

    dev = torch.device(device)
    check_worker(role, [part(load) for load in loads], dev, settings)
    enforce_budget(dev, settings)


def preflight_tail(
    registry: Configs, target: str, layers: tuple[int, int], settings: Settings, *, head: bool = True
) -> None:
    """`preflight` for a tail (its layers, the final norm and the LM head) or, without `head`, a middle stage, on
    settings.engine.device, or on each of engine.devices the part the worker will load there."""
    load = Load(target, layers, False, head, settings.engine.quant)
    for device, loads in per_device(registry, load, [], settings):
        preflight("tail" if head else "stage", registry, loads, device, settings)


def per_device(registry: Configs, load: Load, beside: list[Load], settings: Settings) -> list[tuple[str, list[Load]]]:
    """What each device of a worker will hold: `load` and `beside` (a head's drafter) on engine.device; with
    engine.devices, `load` cut as the worker cuts it (`chain.device_ranges`), `beside` on the first device; the parts
    on one device together."""
    engine = settings.engine
    if not engine.devices:
        return [(engine.device, [load, *beside])]
    assert load.layers is not None
    dtype = torch.float32 if engine.dtype == "auto" else getattr(torch, engine.dtype)
    extra = sum(whole_bytes(registry.config(b.target), dtype, b.quant) for b in beside)
    cfg = registry.config(load.target)
    ranges = device_ranges(
        cfg, load.layers, len(engine.devices), embed=load.embed, head=load.head, first_extra=extra, dtype=dtype,
        quant=load.quant,
    )  # fmt: skip
    out: dict[str, list[Load]] = {}
    for i, (part, device) in enumerate(zip(ranges, engine.devices, strict=True)):
        first, last = i == 0, i == len(ranges) - 1
        held = out.setdefault(str(torch.device(device)), [])
        held += [
            Load(load.target, part, load.embed and first, load.head and last, load.quant),
            *(beside if first else []),
        ]
    return list(out.items())


def same_device(a: str, b: str) -> bool:
    """Whether two torch device strings name one device ("cuda" is cuda:0; every "cpu" is the one CPU)."""

    def key(d: str) -> tuple[str, str]:
        kind, _, index = d.strip().partition(":")
        return kind, "0" if kind == "cpu" or not index else index

    return key(a) == key(b)


def preflight_head(
    registry: Configs, target: str, layers: tuple[int, int], draft: str | None, settings: Settings
) -> None:
    """`preflight` for a head: its layers and its draft model on one budget, or each on its own device's
    (settings.engine.draft_device)."""
    engine = settings.engine
    own = Load(target, layers, True, False, engine.quant)
    drafter = [Load(draft, None, True, True, engine.draft_quant)] if draft else []
    if engine.draft_device and not same_device(engine.draft_device, engine.device):
        for device, loads in per_device(registry, own, [], settings):
            preflight("head", registry, loads, device, settings)
        preflight("head's drafter", registry, drafter, engine.draft_device, settings)
    else:
        for device, loads in per_device(registry, own, drafter, settings):
            preflight("head", registry, loads, device, settings)
