"""Windowed layers' rings (workers/engine/rings.py): a static pool keeps a sliding-window layer's keys and values in
window + slack positions. Against the same engine keeping every position: the same logits through prompts longer
than the ring (a long step), rounds, rejected drafts rolled back, batched rows and whole drafts, with the ring
wrapping many times; a rollback further back than the slack is refused; the slots cost less."""

from __future__ import annotations

import random

import pytest
import torch

from schemas.settings import Settings
from workers.engine.kvcache import KVPool
from workers.engine.plan import kv_bytes, model_shape
from workers.engine.rings import held, ring_mask
from workers.engine.runner import Engine
from workers.engine.shard import load_shard
from workers.tiny_models import save_tiny_model

WINDOW = 8
SLACK = 12  # an engine of 4-token steps and 4-step drafts: rings of 32 positions


@pytest.fixture(scope="module")
def shard(tmp_path_factory, tokenizers):
    root = tmp_path_factory.mktemp("rings")
    # the lower two layers windowed, the upper two full: a pool with rings beside full-length layers
    types = ["sliding_attention"] * 2 + ["full_attention"] * 2
    target = save_tiny_model(
        root / "qwen2",
        "qwen2",
        tokenizer=tokenizers["qwen2"],
        use_sliding_window=True,
        sliding_window=WINDOW,
        layer_types=types,
    )
    return load_shard(target, None, embed=True, head=True)


def _engine(shard, slack: int | None) -> Engine:
    settings = Settings(engine={"static": True, "max_len": 256, "window_slack": slack, "graph_k": 3})
    return Engine(shard, settings, slots=4, max_draft=4)


def test_held_positions_and_the_masks_two_forms():
    """Ring slot j holds the latest position up to the last written that is j mod R; a long step attends over the
    ring before it, then its own keys."""
    assert held(torch.tensor([[9]]), 4).tolist() == [[8, 9, 6, 7]]
    assert held(torch.tensor([[1]]), 4).tolist() == [[0, 1, -2, -1]]  # never written: negative, never seen
    short = ring_mask(torch.tensor([[8, 9]]), 8, 3)  # slots hold 8, 9, 2, ..., 7
    assert short[0].int().tolist() == [[1, 0, 0, 0, 0, 0, 1, 1], [1, 1, 0, 0, 0, 0, 0, 1]]  # 6-8; 7-9
    long = ring_mask(torch.arange(4, 10)[None], 4, 3)  # 6 + 3 - 1 > 4: the ring before (0..3), then 4..9
    assert long.shape == (1, 6, 10)
    assert long[0, 0].int().tolist() == [0, 0, 1, 1, 1, 0, 0, 0, 0, 0]  # position 4 sees 2, 3 and itself


def test_rings_give_the_logits_of_full_length_caches(shard):
    """Three sequences side by side, prompts of 30-45 tokens (longer than the ring: the long form), then rounds of
    1-4 tokens with rejections rolled back and whole drafts, up to 150 positions (the 32-position ring wraps
    about 4 times): every logit as with every position kept, and the same drafts."""
    rng = random.Random(0)
    full, ring = _engine(shard, None), _engine(shard, SLACK)
    assert not full.pool.rings and set(ring.pool.rings) == {0, 1}
    assert ring.pool.keys[0].shape[2] == 32 and ring.pool.keys[2].shape[2] == full.pool.keys[2].shape[2]
    vocab = shard.config.vocab_size
    pairs = [(full.acquire(need=200), ring.acquire(need=200)) for _ in range(3)]
    lens = [rng.randint(30, 45) for _ in pairs]
    with torch.inference_mode():
        prompts = [torch.randint(0, vocab, (n,)) for n in lens]
        a = full.forward_many([p[0] for p in pairs], prompts, [0] * 3, 1)
        b = ring.forward_many([p[1] for p in pairs], prompts, [0] * 3, 1)
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-4)
        while min(lens) < 150:
            if rng.random() < 0.3:  # a whole draft of 4 steps from a feed of 1-2 tokens, then its rollback
                feeds = [[rng.randrange(vocab) for _ in range(rng.randint(1, 2))] for _ in pairs]
                da = full.draft_many([p[0] for p in pairs], feeds, lens, [4] * 3)
                db = ring.draft_many([p[1] for p in pairs], feeds, lens, [4] * 3)
                assert da is not None and torch.equal(da, db)
                for (ca, cb), n, f in zip(pairs, lens, feeds, strict=True):
                    keep = n + rng.randint(0, len(f) + 3)
                    ca.crop(keep), cb.crop(keep)
                lens = [c.length for c, _ in pairs]
                continue
            steps = [torch.randint(0, vocab, (rng.randint(1, 4),)) for _ in pairs]
            a = full.forward_many([p[0] for p in pairs], steps, lens, [s.shape[0] for s in steps])
            b = ring.forward_many([p[1] for p in pairs], steps, lens, [s.shape[0] for s in steps])
            for x, y in zip(a, b, strict=True):
                torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-4)
            for (ca, cb), n, s in zip(pairs, lens, steps, strict=True):
                keep = n + rng.randint(1, s.shape[0])  # a rejected draft: some of the round's tokens rolled back
                ca.crop(keep), cb.crop(keep)
            lens = [c.length for c, _ in pairs]
        # one sequence alone (a batch of one), after all that
        x = torch.randint(0, vocab, (3,))
        a1 = full.forward(pairs[0][0], x, lens[0], 3)
        b1 = ring.forward(pairs[0][1], x, lens[0], 3)
        torch.testing.assert_close(b1, a1, rtol=1e-4, atol=1e-4)


def test_a_rollback_past_the_slack_is_refused(shard):
    """The ring keeps SLACK positions beyond the window: a cache that wrote further than that past the length it
    is rolled back to says so (its window's keys may be overwritten), where a full-length cache rolls back."""
    ring = _engine(shard, SLACK)
    cache = ring.acquire(need=200)
    with torch.inference_mode():
        ring.forward(cache, torch.zeros(40, dtype=torch.long), 0, 1)
        ring.forward(cache, torch.zeros(4, dtype=torch.long), 40, 1)
    cache.crop(41)  # 44 - 41 <= 12
    with pytest.raises(ValueError, match="keeps 12 positions beyond its window"):
        cache.crop(20)
    cache.crop(0)  # emptied: always


def test_rings_cost_less_than_full_slots(shard):
    """A slot's bytes count each windowed layer at its ring: here half the layers at 32 of 272 positions."""
    full = KVPool.slot_bytes(shard, 256, 16)
    ringed = KVPool.slot_bytes(shard, 256, 16, ring_slack=SLACK)
    assert ringed == full // 2 + full // 2 * 32 // 272


def test_the_plan_counts_rings_as_the_pools_hold_them(shard):
    """`shardflow plan` sizes a slot as the engines' pools do: windowed layers at their rings (the engines' slack is
    at least their scratch), the others at every position."""
    shape = model_shape(shard.config, torch.float32)
    assert shape.window_layer == (WINDOW, WINDOW, None, None)
    per = shape.kv_layer[0]
    assert kv_bytes(shape, (0, 4), 256, 16) == 4 * per * 272
    assert kv_bytes(shape, (0, 4), 256, 16, SLACK) == 2 * per * 32 + 2 * per * 272  # max(12, 16) + 8 -> 32
    assert kv_bytes(shape, (0, 4), 256, 16, SLACK) == KVPool.slot_bytes(shard, 256, 16, ring_slack=16)
