"""Reading a checkpoint's tensors: a model's directory (a local one, or a hub id's download), its safetensors files
by tensor name, and the helpers `load_shard` (workers/engine/shard.py) materialises a skeleton's modules with."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from schemas.errors import ModelLoadError

Source = Callable[[dict[str, str], dict[str, tuple], torch.dtype, str], dict[str, torch.Tensor]]


def resolve_model_dir(model: str | Path) -> Path:
    """A local model directory, or a hub id downloaded (weights as safetensors) into the HF cache."""
    path = Path(model)
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(model), allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"]))
    except Exception as e:
        raise ModelLoadError(f"{model!r} is neither a local directory nor a reachable hub model: {e}") from None


def weight_files(model_dir: Path) -> dict[str, Path]:
    """Map each tensor name of a safetensors checkpoint (single or multi-file) to its file."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: model_dir / f for k, f in weight_map.items()}
    single = model_dir / "model.safetensors"
    if not single.exists():
        raise ModelLoadError(f"no safetensors weights in {model_dir}")
    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def read_tensors(files: dict[str, Path], names: dict[str, str], dtype: torch.dtype, device: str) -> dict:
    """Read checkpoint tensors `names` (local name -> checkpoint name) and cast them."""
    missing = [c for c in names.values() if c not in files]
    if missing:
        raise ModelLoadError(f"checkpoint lacks tensors {missing[:4]}")
    out: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for local, ckpt in names.items():
        by_file.setdefault(files[ckpt], []).append((local, ckpt))
    for path, pairs in by_file.items():
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for local, ckpt in pairs:
                out[local] = f.get_tensor(ckpt).to(device=device, dtype=dtype)
    return out


def read_slice(
    files: dict[str, Path], name: str, dim: int, start: int, stop: int, dtype: torch.dtype, device: str
) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) start:stop of one checkpoint tensor, reading only those from its file (a
    shard's part of a table packed across layers: Gemma 4's per-layer embeddings, workers/engine/per_layer.py)."""
    if name not in files:
        raise ModelLoadError(f"checkpoint lacks tensors {[name]}")
    with safe_open(str(files[name]), framework="pt", device="cpu") as f:
        part = f.get_slice(name)
        got = part[start:stop] if dim == 0 else part[:, start:stop]
    return got.to(device=device, dtype=dtype)


def materialise(
    module: nn.Module, prefix: str, source: Source, dtype: torch.dtype, device: str, alias: dict | None = None
) -> None:
    """Give `module`'s parameters/buffers the tensors saved under `prefix` (alias: local -> checkpoint name)."""
    state = dict(module.state_dict(keep_vars=True))
    names = {k: (alias or {}).get(k, f"{prefix}{k}") for k in state}
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    module.load_state_dict(source(names, shapes, dtype, device), assign=True, strict=True)


def read_raw(files: dict[str, Path], names: list[str]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors as stored (a pre-quantized checkpoint's codes and statistics), on the CPU."""
    missing = [n for n in names if n not in files]
    if missing:
        raise ModelLoadError(f"checkpoint lacks tensors {missing[:4]}")
    out: dict[str, torch.Tensor] = {}
    for n in names:
        with safe_open(str(files[n]), framework="pt", device="cpu") as f:
            out[n] = f.get_tensor(n)
    return out


def materialise_rest(module: nn.Module, prefix: str, source: Source, dtype: torch.dtype, device: str) -> None:
    """Load what is still on the meta device under `module` (a pre-quantized layer's norms), by name."""
    owners = {
        f"{m_name}.{p_name}".lstrip("."): (mod, p_name)
        for m_name, mod in module.named_modules()
        for p_name, p in mod.named_parameters(recurse=False)
        if p.is_meta
    }
    names = {k: f"{prefix}{k}" for k in owners}
    tensors = source(names, {k: tuple(getattr(m, n).shape) for k, (m, n) in owners.items()}, dtype, device)
    for k, (mod, p_name) in owners.items():
        setattr(mod, p_name, nn.Parameter(tensors[k], requires_grad=False))


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Build modules with their parameters on the meta device (loaded later, layer by layer) but their buffers
    real: what a module computes in its constructor and no checkpoint holds (Gemma's embedding scale) stays."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def prefix_of(root: nn.Module, target: nn.Module) -> str:
    for name, mod in root.named_modules():
        if mod is target:
            return f"{name}." if name else ""
    raise ModelLoadError("model layout not understood (module not found)")
