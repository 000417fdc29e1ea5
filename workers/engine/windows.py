"""Sliding-window attention as a config turns it on: each layer's window (None: the layer sees every earlier
position), and the families whose windowed layers a shard runs (workers/engine/shard.py applies the windows in the
masks it builds over every cache: `Shard._masks`, workers/engine/kvcache.py `causal`)."""

from __future__ import annotations

from transformers import PretrainedConfig

# families whose windowed layers run here: their layers attend through the masks a shard builds
WINDOWED = {
    "qwen2", "qwen3", "mistral", "ministral", "gemma2", "gemma3_text", "gemma4_text", "olmo3", "cohere2", "gpt_oss",
}  # fmt: skip


def layer_windows(config: PretrainedConfig) -> list[int | None]:
    """Each layer's attention window as the config turns it on (its `layer_types`' sliding layers, every layer of a
    Mistral with a `sliding_window`), None for a layer that sees every earlier position, and for a window no
    shorter than the model's context (it never cuts anything)."""
    n, window = config.num_hidden_layers, getattr(config, "sliding_window", None)
    if window is None or window >= (getattr(config, "max_position_embeddings", None) or window + 1):
        return [None] * n
    types = getattr(config, "layer_types", None)
    if types:
        return [window if t == "sliding_attention" else None for t in types]
    return [window] * n if config.model_type == "mistral" else [None] * n


def sliding_window(config: PretrainedConfig) -> int | None:
    """The attention window a config turns on for some layer (Mistral's `sliding_window`, Qwen2's sliding layers),
    or None."""
    return next((w for w in layer_windows(config) if w is not None), None)
