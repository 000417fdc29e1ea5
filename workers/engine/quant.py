"""Weight-only quantized shards through bitsandbytes: `int8` (LLM.int8() weights, no outlier split) and
`4bit` (NF4, blocks of 64), for the decoder layers' linears of a target's shards and of a drafter.

Why bitsandbytes: the cards ShardFlow is for are 16 GB T4s (sm_75), where its NF4 (sm >= 6.0) and int8
(sm >= 7.5) kernels run, as they do on CPUs, so CI tests the same code the GPU runs; torchao's int4
weight-only kernels (tinygemm) need sm_80 and bf16, and its releases are tied to one torch release each
(the GPU image has torch 2.11, CI 2.13). It is also what transformers' own quantization integration
(`BitsAndBytesConfig`) uses, so a split quantized model equals HF `generate` on the same quantized model:
the modules here are bitsandbytes' `Linear4bit` / `Linear8bitLt`, made the way transformers makes them
(NF4 without nested statistics, int8 with threshold 0), and both the fused forward and the HF layers
call them.

Quantizing happens as each layer loads (`quantize_layer`), so peak memory stays one full-width layer above
the quantized shard; `prequantized_layer` loads a checkpoint transformers saved already quantized.
Embeddings, norms and the LM head stay at the shard's dtype (as transformers leaves them).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from schemas.errors import ModelLoadError

SCHEMES = ("none", "int8", "4bit")
BLOCKSIZE = 64


class _OncePerProcess(logging.Filter):
    """bitsandbytes logs a warning on every int8 matmul of a float32 input (it casts to float16): keep the first."""

    seen = False

    def filter(self, record: logging.LogRecord) -> bool:
        if "inputs will be cast" not in record.getMessage():
            return True
        first, _OncePerProcess.seen = not _OncePerProcess.seen, True
        return first


logging.getLogger("bitsandbytes.autograd._functions").addFilter(_OncePerProcess())


def _bnb():
    try:
        import bitsandbytes as bnb
    except ImportError as e:  # pragma: no cover - a dependency of the package
        raise ModelLoadError(f"quantized shards need bitsandbytes: {e}") from None
    return bnb


def check_scheme(scheme: str) -> str:
    if scheme not in SCHEMES:
        raise ModelLoadError(f"unknown quantization {scheme!r} (one of {', '.join(SCHEMES)})")
    return scheme


def quantized_bytes(rows: int, cols: int, scheme: str, dtype_bytes: int) -> int:
    """Bytes a linear's [rows, cols] weight takes under `scheme`: full width (dtype_bytes a parameter); int8
    codes + a float32 scale a row; 4-bit codes + a float32 absmax a block of 64 + the 16-value code book."""
    n = rows * cols
    if check_scheme(scheme) == "int8":
        return n + 4 * rows
    if scheme == "4bit":
        return (n + 1) // 2 + 4 * -(-n // BLOCKSIZE) + 16 * 4
    return n * dtype_bytes


def _linears(module: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    return [
        (parent, name, child)
        for parent in module.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]


def _empty(kind: type, lin: nn.Linear, **kw: object) -> nn.Module:
    out = kind(lin.in_features, lin.out_features, bias=lin.bias is not None, device="meta", **kw)
    out.bias = lin.bias  # keeps the loaded bias (or None)
    exact_on_cpu(out)
    return out


def exact_on_cpu(module: nn.Module) -> nn.Module:
    """Keep a 4-bit module off bitsandbytes' AVX512-BF16 CPU kernel: it rounds inputs to bf16 and its results
    depend on the number of rows (a round's K+1 rows would not equal generate's one-row steps); the other CPU
    path dequantizes and multiplies in the compute dtype, as the CUDA path does. Plain modules: unchanged."""
    if hasattr(module, "support_avx512bf16_for_cpu"):
        module.support_avx512bf16_for_cpu = False
    return module


def quantized_linear(lin: nn.Linear, scheme: str, compute_dtype: torch.dtype) -> nn.Module:
    """A bitsandbytes module computing `lin` with its weight quantized on the weight's own device."""
    bnb = _bnb()
    w = lin.weight.detach()
    if scheme == "4bit":
        q = _empty(bnb.nn.Linear4bit, lin, compute_dtype=compute_dtype, compress_statistics=False, quant_type="nf4")
        q.weight = bnb.nn.Params4bit(
            w, requires_grad=False, blocksize=BLOCKSIZE, compress_statistics=False, quant_type="nf4", module=q
        ).to(w.device)  # quantizes (the full-width tensor is freed once `lin` goes)
        return q
    if scheme == "int8":
        q = _empty(bnb.nn.Linear8bitLt, lin, has_fp16_weights=False, threshold=0.0)
        cb, scb, _ = bnb.functional.int8_vectorwise_quant(w.to(torch.float16))
        q.weight = bnb.nn.Int8Params(cb, requires_grad=False, has_fp16_weights=False)
        q.weight.CB, q.weight.SCB = cb, scb
        return q
    raise ModelLoadError(f"unknown quantization {scheme!r}")


def quantize_layer(layer: nn.Module, scheme: str, compute_dtype: torch.dtype) -> None:
    """Replace every nn.Linear of a loaded layer by its quantized module, in place."""
    for parent, name, lin in _linears(layer):
        setattr(parent, name, quantized_linear(lin, scheme, compute_dtype))


def transformers_config(scheme: str, compute_dtype: torch.dtype):
    """transformers' `BitsAndBytesConfig` that quantizes a whole model the way these shards are quantized (the
    unsplit reference of parity checks)."""
    from transformers import BitsAndBytesConfig

    if check_scheme(scheme) == "4bit":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype)
    if scheme == "int8":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=0.0)
    raise ModelLoadError("no quantization to configure")


TensorReader = Callable[[list[str]], dict[str, torch.Tensor]]


def prequantized_scheme(config: object) -> str:
    """The scheme a checkpoint was saved in by transformers' bitsandbytes integration ('none' if not)."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return "none"
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    if qc.get("quant_method") != "bitsandbytes":
        raise ModelLoadError(f"checkpoint quantized with {qc.get('quant_method')!r}: only bitsandbytes is supported")
    if qc.get("load_in_4bit"):
        if qc.get("bnb_4bit_quant_type", "nf4") != "nf4":
            raise ModelLoadError("only NF4 4-bit checkpoints are supported")
        return "4bit"
    return "int8" if qc.get("load_in_8bit") else "none"


def prequantized_layer(
    layer: nn.Module, prefix: str, scheme: str, keys: set[str], read: TensorReader, device: str, dtype: torch.dtype
) -> None:
    """Give a layer's linears the quantized tensors a checkpoint holds under `prefix` (`read` loads names)."""
    bnb = _bnb()
    for parent, name, lin in _linears(layer):
        p = f"{prefix}{_path(layer, parent)}{name}."
        if scheme == "4bit":
            stats = sorted(k for k in keys if k.startswith(f"{p}weight."))
            got = read([f"{p}weight", *stats])
            q = _empty(bnb.nn.Linear4bit, lin, compute_dtype=dtype, quant_type="nf4")
            quantized_stats = {k.removeprefix(f"{p}weight."): got[k].to(device) for k in stats}
            q.weight = bnb.nn.Params4bit.from_prequantized(
                got[f"{p}weight"], quantized_stats, requires_grad=False, device=device, module=q
            )
        else:
            got = read([f"{p}weight", f"{p}SCB"])
            q = _empty(bnb.nn.Linear8bitLt, lin, has_fp16_weights=False, threshold=0.0)
            cb, scb = got[f"{p}weight"].to(device), got[f"{p}SCB"].to(device)
            q.weight = bnb.nn.Int8Params(cb, requires_grad=False, has_fp16_weights=False)
            q.weight.CB, q.weight.SCB = cb, scb
        if lin.bias is not None:
            q.bias = nn.Parameter(read([f"{p}bias"])[f"{p}bias"].to(device=device, dtype=dtype), requires_grad=False)
        setattr(parent, name, q)


def _path(root: nn.Module, target: nn.Module) -> str:
    for name, mod in root.named_modules():
        if mod is target:
            return f"{name}." if name else ""
    raise ModelLoadError("layer layout not understood")


def is_quantized(module: nn.Module) -> bool:
    """Whether `module` is one of the quantized linears made here (no bitsandbytes import for plain ones)."""
    return type(module).__module__.startswith("bitsandbytes")


def state_bytes(module: nn.Module) -> int:
    """Bytes the quantized linears under `module` hold beside their parameters (4-bit block statistics, int8
    row scales)."""
    out = 0
    for m in module.modules():
        if not is_quantized(m):
            continue
        qs = getattr(m.weight, "quant_state", None)
        tensors = [qs.absmax, qs.code] if qs is not None else [getattr(m.weight, "SCB", None)]
        out += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    return out
