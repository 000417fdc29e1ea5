"""What each layer of a shard caches a position: key/value heads, key width and value width (`kv_dims` for a model's
one width, `pool_dims` for each layer of a shard, as its static pool holds them: workers/engine/kvcache.py), and how
many positions a slot holds (`slot_length`)."""

from __future__ import annotations

from typing import Any

from workers.engine.per_layer import cached_dims
from workers.engine.rings import attention_layers


def slot_length(max_len: int, scratch: int) -> int:
    """Positions a slot holds: max_len + scratch rounded up to a multiple of 16 (kernel alignment), as pools and the
    memory plan count them."""
    return -(-(max_len + scratch) // 16) * 16


def kv_dims(cfg: Any, attention: Any = None) -> tuple[int, int, int]:
    """(key/value heads, key width, value width) a layer caches per position. A head's width for both; with latent
    attention (DeepSeek-V3, GLM-4 MoE Lite: an `attention` module that expands its cache), one compressed latent
    (kv_lora_rank wide) and one rotary key (qk_rope_head_dim); with latent attention whose cache is expanded
    (DeepSeek-V2), qk_nope + qk_rope wide keys and v_head_dim wide values, one of each per query head."""
    if hasattr(type(attention), "expand_kv"):
        return 1, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    if getattr(cfg, "qk_nope_head_dim", None) and getattr(cfg, "v_head_dim", None):
        return cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads, head_dim, head_dim


def pool_dims(shard: Any) -> dict[int, tuple[int, int, int]]:
    """Each layer of a shard that caches keys and values -> what it caches a position (`kv_dims`): one width for
    every attending layer, or each layer's own where the family's vary (Gemma 4: `per_layer.cached_dims`)."""
    if (dims := cached_dims(shard)) is not None:
        return dims
    ids, attention = attention_layers(shard)
    return dict.fromkeys(ids, kv_dims(shard.config, attention))
