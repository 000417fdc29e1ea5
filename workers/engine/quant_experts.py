"""Quantized experts of mixture-of-experts layers: transformers 5 holds a layer's experts as 3-D parameters of one
module (`Qwen3MoeExperts.gate_up_proj` [experts, 2 x intermediate, hidden], `.down_proj` [experts, hidden,
intermediate]; gpt-oss's transposed, beside its biases), which `quant.quantize_layer` (nn.Linear only) leaves as they
are.

`quantize_experts` stores every such weight quantized as the layer loads: `4bit` as bitsandbytes NF4 over the
flattened tensor (blocks of 64, float32 absmax a block, no nested statistics: as quant.py's linears), `int8` as
absmax codes over the last dimension (a float32 scale a row). The codes and statistics are buffers (so `.to()` and
`Shard.weight_bytes` see them), and the module's class becomes a subclass of its own whose weight names are
properties that dequantize into the compute dtype on each access: the experts' forward is transformers' own
(grouped GEMM by default, whatever the config's experts implementation), reading the dequantized tensors as it read
the parameters. No host syncs, no data-dependent shapes: the fused path's CUDA graphs capture it.

Weight-only quantization, dequantized then multiplied, is deterministic: a model whose expert weights are replaced
by their dequantized values (`fake_quantize`) computes exactly what the quantized shard computes (the reference of
tests/test_quant_experts.py; transformers' own `BitsAndBytesConfig` leaves fused experts full width). Each forward
dequantizes one layer's experts whole (every expert, not only those routed to): `dequantized_bytes` is that
scratch, counted in a worker's workspace (sizing.shard_workspace, plan.model_shape's `experts_scratch`).
Checkpoints stored quantized (`quant.prequantized_layer`) keep their experts as the checkpoint holds them.
"""

from __future__ import annotations

import torch
from torch import nn

from schemas.errors import ModelLoadError
from workers.engine.quant import BLOCKSIZE, _bnb, check_scheme


def expert_weights(module: nn.Module) -> list[tuple[nn.Module, str]]:
    """(owner, name) of every 3-D weight under `module`: a mixture's stacked experts (convolutions' 3-D kernels, a
    linear-attention layer's, are not experts)."""
    return [
        (m, name)
        for m in module.modules()
        if not isinstance(m, nn.modules.conv._ConvNd)
        for name, p in m._parameters.items()
        if p is not None and p.dim() == 3
    ]


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Absmax int8 codes over the last dimension and the float32 scale of each row ([..., 1]), expert by expert (at
    most one expert's float32 copy is made)."""
    codes = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    scales = torch.empty((*w.shape[:-1], 1), dtype=torch.float32, device=w.device)
    for i in range(w.shape[0]):
        x = w[i].float()
        scales[i] = x.abs().amax(-1, keepdim=True) / 127
        codes[i] = torch.round(x / scales[i].clamp(min=torch.finfo(torch.float32).tiny)).to(torch.int8)
    return codes, scales


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes x scales in `dtype` (int8 codes are exact in every float dtype): one kernel, one tensor of the weight's
    size."""
    return codes * scales.to(dtype)


def quantize_nf4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bitsandbytes NF4 codes (two a byte, [n / 2, 1]) and the float32 absmax of each block of 64."""
    codes, state = _bnb().functional.quantize_4bit(
        w.contiguous(), blocksize=BLOCKSIZE, compress_statistics=False, quant_type="nf4"
    )
    return codes, state.absmax


def dequantize_nf4(codes: torch.Tensor, absmax: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    functional = _bnb().functional
    state = functional.QuantState(absmax=absmax, shape=shape, dtype=dtype, blocksize=BLOCKSIZE, quant_type="nf4")
    return functional.dequantize_4bit(codes, state)


class _Dequantizing:
    """What the experts' subclass adds: its weights stored quantized (`_stored`: name -> scheme, shape, dtype), each
    read through `dequantized`."""

    _stored: dict[str, tuple[str, torch.Size, torch.dtype]]

    def dequantized(self, name: str) -> torch.Tensor:
        scheme, shape, dtype = self._stored[name]
        codes: torch.Tensor = getattr(self, f"{name}_codes")
        if scheme == "int8":
            return dequantize_int8(codes, getattr(self, f"{name}_scales"), dtype)
        return dequantize_nf4(codes, getattr(self, f"{name}_absmax"), shape, dtype)


_CLASSES: dict[tuple[type, tuple[str, ...]], type] = {}


def _subclass(cls: type, names: tuple[str, ...]) -> type:
    """`cls` with `names` read through `_Dequantizing.dequantized` (one class per experts class and names)."""
    if (cls, names) not in _CLASSES:
        props = {n: property(lambda self, n=n: self.dequantized(n)) for n in names}
        _CLASSES[cls, names] = type(f"Quantized{cls.__name__}", (_Dequantizing, cls), props)
    return _CLASSES[cls, names]


def quantize_experts(layer: nn.Module, scheme: str) -> None:
    """Store every expert weight of a loaded layer quantized (`scheme` int8 or 4bit), in place; dequantized into the
    weight's own dtype (the shard's compute dtype) at each forward."""
    if check_scheme(scheme) == "none":
        return
    by_owner: dict[nn.Module, list[str]] = {}
    for owner, name in expert_weights(layer):
        by_owner.setdefault(owner, []).append(name)
    for owner, names in by_owner.items():
        if isinstance(owner, _Dequantizing):
            raise ModelLoadError(f"{type(owner).__name__} is quantized already")
        stored = {}
        for name in names:
            w = owner._parameters.pop(name).detach()  # type: ignore[union-attr]
            stored[name] = (scheme, w.shape, w.dtype)
            if scheme == "int8":
                codes, stat, stat_name = *quantize_int8(w), "scales"
            else:
                codes, stat, stat_name = *quantize_nf4(w), "absmax"
            del w  # the full-width tensor goes once its codes are made
            owner.register_buffer(f"{name}_codes", codes, persistent=False)
            owner.register_buffer(f"{name}_{stat_name}", stat, persistent=False)
        owner.__class__ = _subclass(type(owner), tuple(names))
        owner._stored = stored


def fake_quantize(module: nn.Module, scheme: str) -> nn.Module:
    """Replace every expert weight under `module` by its dequantized value (full width, in place): the exact
    reference of a shard whose experts are quantized with `scheme`. Returns `module`."""
    check_scheme(scheme)
    with torch.no_grad():
        for owner, name in expert_weights(module):
            w = owner._parameters[name]
            assert w is not None
            if scheme == "int8":
                w.copy_(dequantize_int8(*quantize_int8(w), w.dtype))
            elif scheme == "4bit":
                w.copy_(dequantize_nf4(*quantize_nf4(w), w.shape, w.dtype))
    return module


def quantized_experts(module: nn.Module) -> list[nn.Module]:
    """The experts modules under `module` whose weights are stored quantized (`quantize_experts`)."""
    return [m for m in module.modules() if isinstance(m, _Dequantizing)]


# Copies of one layer's dequantized experts a CUDA worker holds at once: one in its graphs' memory pool (their
# captures keep it), one more for a forward outside it (a graph's warm-up, a prompt). Counted once, a
# Qwen3-30B-A3B-shaped 4-bit head ran out of memory capturing its graphs (docs/runs/journal.md, run 80).
EXPERT_COPIES = 2


def dequantized_bytes(layer: nn.Module) -> int:
    """Bytes `layer`'s forwards keep dequantized at once: every quantized expert weight at full width, in
    EXPERT_COPIES copies."""
    return EXPERT_COPIES * sum(
        shape.numel() * torch.empty((), dtype=dtype).element_size()
        for m in quantized_experts(layer)
        for _, shape, dtype in m._stored.values()  # type: ignore[attr-defined]
    )
