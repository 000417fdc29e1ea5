"""Multimodal wrappers (Gemma 3, Qwen3.5, Mistral 3, ...): a checkpoint whose text model sits beside a vision tower,
its decoder stored under another prefix (`language_model.model.`, `model.language_model.`, ...). A shard is the
text model alone: built from the text config (`text_config`), its tensors read under the wrapper's names
(`stored_aliases`); the vision tower and projector are never read.

    config = text_config(AutoConfig.from_pretrained(model_dir))     # Gemma3TextConfig for a Gemma3Config
    aliases = stored_aliases(skeleton, set(files))                  # text model name -> stored name
"""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The config of the text model a shard runs: a wrapper's text config, else the config itself."""
    text = config.get_text_config(decoder=True)
    return text if text is not None else config


def stored_aliases(skeleton: nn.Module, keys: set[str]) -> dict[str, str]:
    """The text model's tensor names -> the checkpoint's, for a checkpoint that stores its decoder under another
    prefix than the text model's own (empty when the names already match). The prefix is the one under which
    every tensor of the first layer is stored (a vision tower's layers have names of their own)."""
    base = skeleton.get_decoder()
    own = _prefix(skeleton, base)  # "model."
    layer0 = [n for n, _ in base.layers[0].named_parameters()]
    if not layer0 or f"{own}layers.0.{layer0[0]}" in keys:
        return {}
    tail = f"layers.0.{layer0[0]}"
    found = [k[: -len(tail)] for k in keys if k.endswith(tail)]
    found = [p for p in found if all(f"{p}layers.0.{n}" in keys for n in layer0)]
    if not found:
        return {}
    stored = min(found, key=len)
    out = {own + k[len(stored) :]: k for k in keys if k.startswith(stored)}
    head = skeleton.get_output_embeddings()
    if head is not None:
        mine = f"{_prefix(skeleton, head)}weight"
        candidates = sorted((k for k in keys if k.endswith(f".{mine}")), key=len)
        if mine not in keys and candidates:
            out[mine] = candidates[0]
    return out


def _prefix(root: nn.Module, target: nn.Module) -> str:
    name = next(n for n, m in root.named_modules() if m is target)
    return f"{name}." if name else ""
