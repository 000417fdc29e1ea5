"""The attention kernel ShardFlow's shards use: PyTorch SDPA with an explicit mask, with grouped-query
attention done by folding each key/value head's query heads into the query length.

Query heads h = i * g + j (g = query heads per key/value head) all attend to key/value head i, so
[B, Hq, T, D] viewed as [B, Hkv, g * T, D] attends to the caches as they are: no per-head copies of
K/V (SDPA's `enable_gqa` takes the math kernel whenever a mask is given, and that kernel repeats K/V
per query head: with batched static caches, gigabytes per forward), and the memory-efficient kernel
applies. The mask is repeated over the folded query rows (small: rows x cache length booleans).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface

NAME = "shardflow_sdpa"


def gqa_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **_: object,
) -> tuple[torch.Tensor, None]:
    b, hq, t, d = query.shape
    hkv = key.shape[1]
    g = hq // hkv
    mask = attention_mask
    if g > 1:
        query = query.reshape(b, hkv, g * t, d)
        if mask is not None:
            mb, _, _, length = mask.shape
            mask = mask[:, :, None].expand(mb, 1, g, t, length).reshape(mb, 1, g * t, length)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(b, hq, t, d).transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, gqa_sdpa)
