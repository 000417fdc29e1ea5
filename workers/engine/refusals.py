"""What a worker refuses at load, and `shardflow plan` in the same words (workers/engine/plan.py): a model not laid out
as a shard runs it, sliding windows of a family whose windows do not run here, float16 where the family overflows it,
layers whose state cannot be rolled back (a split that parts Gemma 4's shared keys: workers/engine/per_layer.py)."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from schemas.errors import ModelLoadError
from workers.engine.recurrent import RECURRENT
from workers.engine.windows import WINDOWED, sliding_window


def refuse_layout(model: nn.Module) -> None:
    """ModelLoadError for a model whose decoder lacks the parts a shard runs (layers, rotary, final norm, embedding)."""
    if not all(hasattr(model.get_decoder(), a) for a in ("layers", "rotary_emb", "norm", "embed_tokens")):
        raise ModelLoadError(f"{type(model).__name__} is not laid out like Qwen2/Llama")


def refuse_windows(config: PretrainedConfig) -> None:
    """ModelLoadError for sliding windows of a family whose windows do not run here (`windows.WINDOWED`)."""
    window = sliding_window(config)
    if window is not None and config.model_type not in WINDOWED:
        raise ModelLoadError(f"sliding-window attention ({window} positions) is not supported for {config.model_type}")


# families whose activations pass float16's range in their released weights (Gemma's scaled embeddings and
# unnormalised residual stream: HF's own Gemma 2/3 docs run them in bfloat16)
HALF_UNSAFE = {"gemma2", "gemma3_text", "gemma4_text"}


def refuse_half(config: PretrainedConfig, dtype: torch.dtype) -> None:
    """ModelLoadError for float16 where the family is known to overflow it, saying what to run instead."""
    if dtype == torch.float16 and config.model_type in HALF_UNSAFE:
        raise ModelLoadError(
            f"{config.model_type} overflows float16 (its activations pass 65504): run it with --dtype bfloat16, "
            "or float32 on a GPU without bfloat16 (a T4)"
        )


def refuse_layers(config: PretrainedConfig, layers: nn.ModuleList | list, first: int = 0) -> None:
    """ModelLoadError, naming the first, for layers that keep a state a shard cannot roll back (Mamba-style mixers,
    short convolutions: any layer without attention outside the linear-attention families of `recurrent.py`)."""
    for i, layer in enumerate(layers, start=first):
        if not hasattr(layer, "self_attn") and config.model_type not in RECURRENT:
            raise ModelLoadError(
                f"{config.model_type}: layer {i} ({type(layer).__name__}) keeps a recurrent state rather than a KV "
                "cache (linear attention); such layers are not supported yet"
            )
