"""A draft model's batched steps over several sessions' caches, below the drafters (workers/speculative/drafters.py):
long feeds prefilled in one batched forward (`prefilled`), and drafts by one batched forward per position
(`draft_steps`, where no whole-draft graph applies)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from workers.engine.numerics import row_argmax
from workers.engine.runner import Engine


def prefilled(engine: Engine, caches: list, plans: list[tuple[list[int], int]]) -> list[tuple[list[int], int]]:
    """Plans whose feeds are longer than a graph step (a new session's prompt, a replay) prefilled up to their
    last token, in one batched forward: the whole draft then runs through the graph with the other rows, rather
    than every row of the batch drafting step by step (and capturing step graphs at first use)."""
    if not engine.static:  # no whole-draft graph to join: the step path takes the feed whole
        return plans
    long = [i for i, (feed, _) in enumerate(plans) if len(feed) - 1 > engine.step_tokens]
    if not long:
        return plans
    feeds = [torch.tensor(plans[i][0][:-1], device=engine.shard.device) for i in long]
    engine.forward_many([caches[i] for i in long], feeds, [plans[i][1] for i in long], logits_last=0)
    out = list(plans)
    for i in long:
        feed, start = plans[i]
        out[i] = (feed[-1:], start + len(feed) - 1)
    return out


def argmax_pick(logits: torch.Tensor, live: list[int]) -> torch.Tensor:
    return row_argmax(logits)


def draft_steps(
    engine: Engine,
    caches: list,
    plans: list[tuple[list[int], int]],
    contexts: list[list[int]],
    ks: list[int],
    pick: Callable[[torch.Tensor, list[int]], torch.Tensor],
) -> list[list[int]]:
    """Drafts of max(ks) tokens per row: one batched forward per draft position, `pick(logits [live, V], live
    rows)` choosing each live row's token, fed back on the device; rows whose k is reached drop out. One host
    sync at the end."""
    feeds = [torch.tensor(f, device=engine.shard.device) for f, _ in plans]
    logits = engine.forward_many(caches, feeds, [k for _, k in plans], logits_last=1)
    live = list(range(len(caches)))
    cur = pick(torch.stack([lg[-1] for lg in logits]), live)
    steps = [(live, cur)]
    for i in range(1, max(ks)):
        keep = [j for j, b in enumerate(live) if ks[b] > i]
        if len(keep) < len(live):
            cur, live = cur[keep], [live[j] for j in keep]
        starts = [len(contexts[b]) + i - 1 for b in live]
        logits = engine.forward_many([caches[b] for b in live], list(cur[:, None]), starts, logits_last=1)
        cur = pick(torch.stack([lg[-1] for lg in logits]), live)
        steps.append((live, cur))
    flat = iter(torch.cat([c for _, c in steps]).tolist())
    rows: list[list[int]] = [[] for _ in caches]
    for rows_live, _ in steps:
        for b in rows_live:
            rows[b].append(next(flat))
    return rows
