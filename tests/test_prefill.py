"""Prompts of sequences in flight run as batched forwards (Engine.forward_many's eager batches of long steps):
each row gets what its prompt gives alone, the padding after a shorter prompt never reaches a later round, and
batches stay within `prefill_tokens` padded tokens and their slots."""

from __future__ import annotations

import pytest
import torch

from schemas.settings import Settings
from workers.engine.batches import pick_last
from workers.engine.kvcache import KVCache
from workers.engine.runner import Engine
from workers.engine.shard import load_shard


def _reference(shard, tokens: list[torch.Tensor], wants: list[int]) -> list[torch.Tensor]:
    """Each sequence alone through a growing cache: (prompt output, then a 3-token round's output)."""
    out = []
    for x, w in zip(tokens, wants, strict=True):
        cache = KVCache()
        out.append(shard(x[:-3], 0, cache, w))
        out.append(shard(x[-3:], x.shape[0] - 3, cache, 2 if w else 0))
    return out


@pytest.mark.parametrize("wants", [[3, 1, 2, 5], [0, 0, 0, 0]], ids=["logits", "hidden"])
@torch.inference_mode()
def test_prompts_run_batched_and_equal_each_alone(models, wants):
    shard = load_shard(models["qwen2"].target, None, embed=True, head=True)
    v = shard.config.vocab_size
    lengths = [23, 9, 31, 14]
    tokens = [torch.arange(7 * i, 7 * i + n) % v for i, n in enumerate(lengths)]
    engine = Engine(shard, Settings(engine={"static": True, "max_len": 64}), step_tokens=4, slots=4)
    calls: list[int] = []
    run = shard.run_batch

    def counting(x, *args, **kwargs):
        calls.append(x.shape[0])
        return run(x, *args, **kwargs)

    shard.run_batch = counting  # type: ignore[method-assign]
    try:
        caches = [engine.acquire() for _ in lengths]
        first = engine.forward_many(caches, [x[:-3] for x in tokens], [0] * 4, wants)
        assert calls == [4]  # the four prompts: one batched forward
        assert [c.length for c in caches] == [n - 3 for n in lengths]
        later = engine.forward_many(caches, [x[-3:] for x in tokens], [n - 3 for n in lengths], 2 if wants[0] else 0)
    finally:
        del shard.run_batch
    want = _reference(shard, tokens, wants)
    got = [t for pair in zip(first, later, strict=True) for t in pair]
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want, strict=True):
        assert torch.allclose(g, w, atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_prompt_batches_keep_to_their_budget_and_slots(models):
    """Batches of at most prefill_tokens padded tokens; a row whose padding would pass its slot runs alone."""
    shard = load_shard(models["qwen2"].target, None, embed=True, head=True)
    engine = Engine(
        shard, Settings(engine={"static": True, "max_len": 40, "prefill_tokens": 40}), step_tokens=4, slots=4
    )
    caches = [engine.acquire() for _ in range(4)]
    xs = [torch.arange(n) for n in (12, 10, 12, 11)]
    assert engine._prefill_parts([0, 1, 2, 3], caches, xs, [0, 0, 0, 0]) == [[0, 1, 2], [3]]
    room = engine.pool.index.shape[0]
    assert engine._prefill_parts([0, 1], caches, xs, [room - 12, 0]) == [[0, 1]]  # its padding just fits
    assert engine._prefill_parts([1, 0, 2], caches, xs, [0, room - 11, 0]) == [[0, 2], [1]]
    assert pick_last(5, 3) == [2, 3, 4] and pick_last(2, 3) == [0, 0, 1]
