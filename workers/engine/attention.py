"""The attention kernel ShardFlow's shards use: PyTorch SDPA with an explicit mask, with grouped-query
attention done by folding each key/value head's query heads into the query length.

Query heads h = i * g + j (g = query heads per key/value head) all attend to key/value head i, so
[B, Hq, T, D] viewed as [B, Hkv, g * T, D] attends to the caches as they are: no per-head copies of
K/V (SDPA's `enable_gqa` takes the math kernel whenever a mask is given, and that kernel repeats K/V
per query head: with batched static caches, gigabytes per forward), and the memory-efficient kernel
applies. The mask is repeated over the folded query rows (small: rows x cache length booleans).
Small problems (a single drafter step) keep SDPA's own GQA, which is faster there.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface

NAME = "shardflow_sdpa"
# Below this many query rows (batch x query heads x tokens) SDPA's own GQA is used (math kernel, K/V
# repeated per query head: small here). On H200s, folding every call slowed a lone 0.5B drafter step
# (1 x 14 heads x 1 token; the memory-efficient kernel then runs 2 thread blocks): draft time per round
# 26.4 -> 32.0 ms (graphs), 14.9 -> 20.8 ms (compiled), while 7B shard rounds (1 x 28 x 9) and batches of
# 16 sequences got faster folded (tail 9.7 -> 7.9 ms, batched tail 21.3 -> 14.7 ms; docs/benchmarks.md).
FOLD_MIN_ROWS = 64


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
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if g == 1 or b * hq * t < FOLD_MIN_ROWS:  # few query rows: the per-head K/V copies are small
        out = sdpa(query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=g > 1)
        return out.transpose(1, 2).contiguous(), None
    mask = attention_mask
    if mask is not None:
        mb, _, _, length = mask.shape
        mask = mask[:, :, None].expand(mb, 1, g, t, length).reshape(mb, 1, g * t, length)
    out = sdpa(query.reshape(b, hkv, g * t, d), key, value, attn_mask=mask, scale=scaling)
    return out.reshape(b, hq, t, d).transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, gqa_sdpa)
