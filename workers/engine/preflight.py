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


def preflight_tail(registry: Configs, target: str, layers: tuple[int, int], settings: Settings) -> None:
    """`preflight` for a tail: its layers, the final norm and the LM head, on settings.engine.device."""
    engine = settings.engine
    preflight("tail", registry, [Load(target, layers, False, True, engine.quant)], engine.device, settings)


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
    own = [Load(target, layers, True, False, engine.quant)]
    drafter = [Load(draft, None, True, True, engine.draft_quant)] if draft else []
    if engine.draft_device and not same_device(engine.draft_device, engine.device):
        preflight("head", registry, own, engine.device, settings)
        preflight("head's drafter", registry, drafter, engine.draft_device, settings)
    else:
        preflight("head", registry, own + drafter, engine.device, settings)
