"""How an engine's rows make up its batched forwards (workers/engine/runner.py): which prompts of a pool run
together, which rows of a step are picked for logits, and the rows padded into one batch (their token ids too)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from workers.engine.kvcache import KVPool


def pick_last(m: int, p: int) -> list[int]:
    """The last p of a row's m rows (the first repeated where m < p: the row wants fewer)."""
    return [max(m - p + j, 0) for j in range(p)]


def check_ids(ids: Sequence[torch.Tensor] | None, xs: Sequence[torch.Tensor], needed: bool) -> None:
    """ValueError unless each row has as many token ids as rows of x, where given or `needed` (a shard whose layers
    take per-layer inputs: Gemma 4's)."""
    if (ids is None and needed) or (ids is not None and any(len(i) != len(x) for i, x in zip(ids, xs, strict=True))):
        raise ValueError("this shard's layers take per-layer inputs: pass the token ids of its rows (ids=)")


def padded(rows: Sequence[torch.Tensor], t: int) -> torch.Tensor:
    """Rows [m_b, ...] as one [B, t, ...] batch, zeros after each row's own m_b (no copy beyond the stack where every
    row is t long)."""
    if min(r.shape[0] for r in rows) == t:
        return torch.stack(list(rows))
    out = rows[0].new_zeros((len(rows), t, *rows[0].shape[1:]))
    for b, r in enumerate(rows):
        out[b, : r.shape[0]] = r
    return out


def prefill_parts(
    idx: list[int], sizes: Sequence[int], starts: Sequence[int], pool: KVPool, budget: int
) -> list[list[int]]:
    """Batches of long steps (prompts; sizes[i] tokens at starts[i]) of one pool: up to `budget` padded tokens each.
    Rows are padded to their batch's longest step, after their own tokens (masked out, overwritten later); a row
    whose padding would run past its slot runs alone. A windowed layer's ring (workers/engine/rings.py) takes no
    padding from a step too long for it, and a shorter step's padding stays within what it can roll back."""
    longest = max(sizes[i] for i in idx)
    room = pool.index.shape[0]
    fits = [i for i in idx if starts[i] + longest <= room]
    parts: list[list[int]] = []
    for i in fits:
        part = parts[-1] if parts else []
        if part and len(part) < pool.slots and (len(part) + 1) * longest <= budget:
            part.append(i)
        else:
            parts.append([i])
    return parts + [[i] for i in idx if i not in fits]
