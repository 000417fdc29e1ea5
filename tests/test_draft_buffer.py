"""A whole draft's steps over a `DraftBuffer` (workers/engine/kvcache.py): the batch's keys and values copied out
of the pool once, written in place, the draft's positions copied back. Equal, token for token and value for value,
to the steps over a `BatchView` (a gather of every row's cache in every layer of every step), padding rows and
rows of different lengths included."""

from __future__ import annotations

import pytest
import torch

from workers.engine.graphs import greedy_steps
from workers.engine.kvcache import BatchView, KVPool
from workers.engine.shard import load_shard


def _viewed_steps(run, pool, rows, x, pos, pick, k, length):
    """The steps as they ran before DraftBuffer: a BatchView per step."""
    cur = run(x, pos, BatchView(pool, rows, pos, length), pick)[:, -1].argmax(-1)
    out = [cur]
    last, zero = pos.gather(1, pick), torch.zeros_like(pick)
    limit = pool.index.shape[0] - 1
    for _ in range(1, k):
        last = (last + 1).clamp(max=limit)
        cur = run(cur[:, None], last, BatchView(pool, rows, last, length), zero)[:, -1].argmax(-1)
        out.append(cur)
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("shared", [False, True])
@torch.inference_mode()
def test_draft_buffer_equals_a_view_per_step(models, shared):
    """shared: the copies land in one storage for every draft of the pool (as on CUDA: `KVPool.draft_copies`)."""
    shard = load_shard(models["qwen2"].drafter, embed=True, head=True)
    pool = KVPool.for_shard(shard, slots=4, max_len=64, scratch=12)
    if shared:
        store = tuple(
            {i: torch.full((t.numel(),), float("nan")) for i, t in p.items()} for p in (pool.keys, pool.values)
        )
        pool.draft_copies = lambda: store
    torch.manual_seed(0)
    for i, n in ((0, 5), (2, 11), (3, 20)):  # three sequences' prompts in their slots (slot 1 stays empty)
        ids = torch.randint(0, shard.config.vocab_size, (1, n))
        pos = torch.arange(n)[None]
        shard.run_batch(ids, pos, BatchView(pool, torch.tensor([i]), pos, None))
    rows = torch.tensor([0, 2, 3, pool.pad_slot])  # a padding row last, on the pad slot's scratch positions
    starts = [5, 11, 20]
    feeds = [[7, 9], [3, 0], [4, 8]]  # the second feeds one token (its pad after it, as Engine.draft_many pads)
    t = 2
    pos = torch.tensor([[s, s + 1] for s in starts] + [pool.index[-t:].tolist()])
    x = torch.tensor(feeds + [[0, 0]])
    pick = torch.tensor([[1], [0], [1], [t - 1]])
    other = KVPool.for_shard(shard, slots=4, max_len=64, scratch=12)
    for i in pool.keys:
        other.keys[i].copy_(pool.keys[i])
        other.values[i].copy_(pool.values[i])
    for length in (32, None):  # attending over part of each slot, or all of it
        want = _viewed_steps(shard.run_batch, other, rows, x, pos, pick, 6, length)
        got = greedy_steps(shard.run_batch, pool, rows, x, pos, pick, 6, length)
        assert torch.equal(got[:3], want[:3])
        for i in pool.keys:  # the real rows' slots hold the same keys and values after the draft
            for slot in (0, 1, 2, 3):
                assert torch.equal(pool.keys[i][slot], other.keys[i][slot]), (i, slot)
                assert torch.equal(pool.values[i][slot], other.values[i][slot]), (i, slot)
