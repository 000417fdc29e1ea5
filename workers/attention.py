"""The attention kernel ShardFlow's shards use: PyTorch SDPA with an explicit mask and native
grouped-query attention (`enable_gqa`), so static caches are not copied per query head each step
(transformers' own SDPA path repeats K/V heads whenever a mask is given)."""

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
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=key.shape[1] != query.shape[1]
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, gqa_sdpa)
