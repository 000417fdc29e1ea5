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

NAME = "shardflow_attention"  # no "sdpa" in it: transformers would check it as its own SDPA (gpt-oss refuses that)
# Below this many query rows (batch x query heads x tokens) SDPA's own GQA is used (math kernel, K/V
# repeated per query head: small here). On H200s, folding every call slowed a lone 0.5B drafter step
# (1 x 14 heads x 1 token; the memory-efficient kernel then runs 2 thread blocks): draft time per round
# 26.4 -> 32.0 ms (graphs), 14.9 -> 20.8 ms (compiled), while 7B shard rounds (1 x 28 x 9) and batches of
# 16 sequences got faster folded (tail 9.7 -> 7.9 ms, batched tail 21.3 -> 14.7 ms; docs/runs/journal.md).
FOLD_MIN_ROWS = 64


def gqa_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    s_aux: torch.Tensor | None = None,
    **_: object,
) -> tuple[torch.Tensor, None]:
    if s_aux is not None:
        return _with_sinks(query, key, value, attention_mask, scaling, s_aux)
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


def _with_sinks(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
    sinks: torch.Tensor,
) -> tuple[torch.Tensor, None]:
    """gpt-oss's attention sinks: each head's learned logit joins the softmax as a key no value follows, so a head
    may attend to nothing (float32 softmax; a row its mask hides entirely stays finite)."""
    b, hq, t, d = query.shape
    g = hq // key.shape[1]
    key, value = key.repeat_interleave(g, 1), value.repeat_interleave(g, 1)
    scores = (query @ key.transpose(-1, -2)).float() * (scaling if scaling is not None else d**-0.5)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    sink = sinks.float().reshape(1, hq, 1, 1).expand(b, hq, t, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return (probs.to(value.dtype) @ value).transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, gqa_sdpa)
