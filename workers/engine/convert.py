"""Checkpoint tensors under the names a transformers 5 module holds: the model's own conversion mapping applied.

Mixture-of-experts checkpoints store each expert's projections one by one (`mlp.experts.3.gate_proj.weight`), while
transformers 5's modules hold them fused (`mlp.experts.gate_up_proj`: every expert's gate and up projections stacked).
transformers declares how one becomes the other for each family (`transformers.conversion_mapping`: renamings, and
converters whose operations stack and concatenate). `converted_names` plans which stored tensors make each module
tensor; `converting_source` reads them through those operations, one module tensor at a time, so a shard still reads
only its own layers' tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from copy import deepcopy
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

from schemas.errors import ModelLoadError

Source = Callable[[dict[str, str], dict[str, tuple], torch.dtype, str], dict[str, torch.Tensor]]
Reader = Callable[[dict[str, str], torch.dtype, str], dict[str, torch.Tensor]]


@dataclass
class Made:
    """One module tensor made from stored ones: the converter that makes it (None: a renamed tensor, read as it is)
    and the stored tensors it takes, with the converter's source pattern each matched (in stored order)."""

    converter: WeightConverter | None
    sources: list[tuple[str, str]] = field(default_factory=list)


def converted_names(model: nn.Module, stored: list[str]) -> dict[str, Made]:
    """For each module tensor name that differs from the stored names: how it is made (transformers' mapping for the
    model's family; empty when the family stores tensors as its modules hold them)."""
    transforms = get_model_conversion_mapping(model, add_legacy=False)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    plan: dict[str, Made] = {}
    for key in sorted(stored, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters)
        if target == key:
            continue
        made = plan.setdefault(target, Made(by_pattern[pattern] if pattern is not None else None))
        made.sources.append((key, pattern or key))
    return plan


def _make(name: str, made: Made, read: Reader, dtype: torch.dtype, device: str) -> torch.Tensor:
    """One module tensor: its stored tensors read (on the CPU, as stored) and put through the converter's
    operations, then cast and moved."""
    stored = read({key: key for key, _ in made.sources}, dtype, "cpu")
    if made.converter is None:
        (tensor,) = stored.values()
        return tensor.to(device=device, dtype=dtype)
    converter = deepcopy(made.converter)  # each module tensor collects its own stored tensors
    for key, pattern in made.sources:
        converter.add_tensor(name, key, pattern, lambda key=key: stored[key])
    out = converter.convert(name)
    if name not in out:
        raise ModelLoadError(f"converting {[k for k, _ in made.sources][:4]} made {list(out)[:4]}, not {name}")
    return out[name].to(device=device, dtype=dtype)


def converting_source(stored: set[str], plan: dict[str, Made], read: Reader) -> Source:
    """A shard's tensor source: a name the checkpoint holds is read as it is, a name the plan makes is made."""

    def source(names: dict[str, str], shapes: dict[str, tuple], dtype: torch.dtype, device: str) -> dict:
        as_stored = {local: ck for local, ck in names.items() if ck in stored or ck not in plan}
        out = read(as_stored, dtype, device)
        for local, ck in names.items():
            if local not in as_stored:
                out[local] = _make(ck, plan[ck], read, dtype, device)
        return out

    return source
