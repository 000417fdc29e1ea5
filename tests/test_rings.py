"""Windowed layers' rings (workers/engine/rings.py): a static pool keeps a sliding-window layer's keys and values in
window + slack positions. Against the same engine keeping every position: the same logits through prompts longer
than the ring (a long step), rounds, rejected drafts rolled back, batched rows and whole drafts, with the ring
wrapping many times; a rollback further back than the slack is refused; the slots cost less."""

from __future__ import annotations

import random

import pytest
import torch

from schemas.settings import Settings
from workers.engine.graphs import greedy_steps
from workers.engine.isolate import run_isolated
from workers.engine.kvcache import BatchView, KVPool
from workers.engine.plan import kv_bytes, model_shape
from workers.engine.rings import held, ring_mask
from workers.engine.runner import Engine
from workers.engine.shard import blank_input, load_shard
from workers.tiny_models import save_tiny_model

WINDOW = 8
SLACK = 64  # the least engine.window_slack allows: rings of 8 + 64 -> 80 positions


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
    """Three sequences side by side, prompts of 75-110 tokens (mostly longer than the ring allows a step: the long
    form), then rounds of 1-4 tokens with rejections rolled back and whole drafts, up to 240 positions (the
    80-position ring wraps 3 times): every logit as with every position kept, and the same drafts."""
    rng = random.Random(0)
    full, ring = _engine(shard, None), _engine(shard, SLACK)
    assert not full.pool.rings and set(ring.pool.rings) == {0, 1}
    assert ring.pool.keys[0].shape[2] == 80 and ring.pool.keys[2].shape[2] == full.pool.keys[2].shape[2]
    vocab = shard.config.vocab_size
    pairs = [(full.acquire(need=256), ring.acquire(need=256)) for _ in range(3)]
    lens = [rng.randint(75, 110) for _ in pairs]
    with torch.inference_mode():
        prompts = [torch.randint(0, vocab, (n,)) for n in lens]
        a = full.forward_many([p[0] for p in pairs], prompts, [0] * 3, 1)
        b = ring.forward_many([p[1] for p in pairs], prompts, [0] * 3, 1)
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-4)
        while max(lens) < 240:
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
    """The ring keeps R - W positions beyond the window: a cache that wrote further than R - W + 1 past the length
    it is rolled back to says so (its window's keys may be overwritten), where a full-length cache rolls back."""
    ring = _engine(shard, SLACK)
    cache = ring.acquire(need=200)
    with torch.inference_mode():
        ring.forward(cache, torch.zeros(100, dtype=torch.long), 0, 1)
        ring.forward(cache, torch.zeros(4, dtype=torch.long), 100, 1)
    cache.crop(101)  # 104 - 101 <= 73
    cache.crop(31)  # 104 - 31 = 73: the furthest back
    with pytest.raises(ValueError, match="keeps 72 positions beyond its window"):
        cache.crop(30)
    cache.crop(0)  # emptied (a replay from position 0): always, and what it wrote before is never read again
    with torch.inference_mode():
        ring.forward(cache, torch.zeros(10, dtype=torch.long), 0, 1)
        ring.forward(cache, torch.zeros(3, dtype=torch.long), 10, 1)
    cache.crop(11)


def test_a_failed_batch_whose_long_part_cannot_be_rolled_back_fails_that_part_alone(shard):
    """A batch fails after its forward wrote: a prompt's second part (110 tokens at 20: further into the ring than a
    rollback can undo) beside two rounds. Each is rewound and run alone (`run_isolated`, as both roles retry a batch):
    the part, whose ring cannot go back, gets its own error; the rounds run alone as on an engine of their own."""
    eng, alone = _engine(shard, SLACK), _engine(shard, SLACK)
    vocab = shard.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (20,), generator=gen) for _ in range(3)]
    steps = [torch.randint(0, vocab, (m,), generator=gen) for m in (110, 3, 4)]
    caches, refs = [eng.acquire(need=200) for _ in range(3)], [alone.acquire(need=200) for _ in range(3)]

    def run(items: list[int]) -> list[torch.Tensor]:
        out = eng.forward_many([caches[i] for i in items], [steps[i] for i in items], [20] * len(items), 1)
        if len(items) > 1:
            raise RuntimeError("the batch failed after its forward wrote")
        return out

    def rewind(i: int) -> None:
        if caches[i].length > 20:
            caches[i].crop(20)

    with torch.inference_mode():
        for c, r, p in zip(caches, refs, prompts, strict=True):
            eng.forward(c, p, 0, 1)
            alone.forward(r, p, 0, 1)
        got = run_isolated([0, 1, 2], run, rewind, lambda i, e: e)
        assert isinstance(got[0], ValueError) and "cannot roll a windowed layer's ring back" in str(got[0])
        for i in (1, 2):
            torch.testing.assert_close(got[i], alone.forward(refs[i], steps[i], 20, 1), rtol=1e-4, atol=1e-4)


def test_padding_past_a_rows_own_end_never_reaches_its_logits(shard):
    """Windowed layers kept at full length (no rings): a round of 5 batched beside a 60-token prompt is padded to 60
    tokens; the batch attends over its padding too, so no padding query's window falls past the attended columns (its
    softmax over nothing would be NaN, and the NaN keys written at the row's padding positions would reach its later
    logits as masked 0 x NaN)."""
    eng, alone = _engine(shard, None), _engine(shard, None)
    vocab = shard.config.vocab_size
    a, b, ref = eng.acquire(), eng.acquire(), alone.acquire()
    with torch.inference_mode():
        first = torch.randint(0, vocab, (100,))
        eng.forward(b, first, 0, 1)
        alone.forward(ref, first, 0, 1)
        prompt, rnd = torch.randint(0, vocab, (60,)), torch.randint(0, vocab, (5,))
        eng.forward_many([a, b], [prompt, rnd], [0, 100], [1, 5])
        alone.forward(ref, rnd, 100, 5)
        for pos in range(105, 140):
            x = torch.randint(0, vocab, (1,))
            torch.testing.assert_close(eng.forward(b, x, pos, 1), alone.forward(ref, x, pos, 1), rtol=1e-4, atol=1e-4)


def test_a_long_round_beside_a_prompt_rolls_back(shard):
    """A round longer than the graphs' steps (a request's k above graph_k) runs eagerly, padded to the prompt it is
    batched with: a step too long for the ring writes no padding there, so every draft of it can still be rejected,
    and the rounds after equal full-length caches."""
    full, ring = _engine(shard, None), _engine(shard, SLACK)
    vocab = shard.config.vocab_size
    pairs = [(full.acquire(need=256), ring.acquire(need=256)) for _ in range(2)]
    with torch.inference_mode():
        first = torch.randint(0, vocab, (60,))
        for engine, i in ((full, 0), (ring, 1)):
            engine.forward(pairs[0][i], first, 0, 1)
        steps = [torch.randint(0, vocab, (10,)), torch.randint(0, vocab, (90,))]  # k = 9 beside a 90-token prompt
        a = full.forward_many([p[0] for p in pairs], steps, [60, 0], [10, 1])
        b = ring.forward_many([p[1] for p in pairs], steps, [60, 0], [10, 1])
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-4)
        for cache in pairs[0]:
            cache.crop(61)  # every draft rejected
        nxt = torch.randint(0, vocab, (4,))
        torch.testing.assert_close(ring.forward(pairs[0][1], nxt, 61, 4), full.forward(pairs[0][0], nxt, 61, 4))


def test_warm_up_on_a_one_slot_pool_leaves_its_sequence_alone(shard):
    """Graph warm-up and capture run a batch of the pool's pad slot at its last positions, forwards and whole drafts
    (workers/engine/graphs.py `BatchGraph`). A one-slot pool's own slot would do for full-length layers (those are
    scratch positions); a ring's wrap onto live ones, so a pool with rings keeps a pad slot at any size."""
    ring = _engine(shard, SLACK)
    pool = ring._new_pool(1)  # as a spare pool (or a one-slot main pool) is made
    assert pool.pad_slot == 1 and pool.keys[0].shape[0] == 2
    cache = pool.acquire()
    with torch.inference_mode():
        ring.forward(cache, torch.randint(0, shard.config.vocab_size, (50,)), 0, 1)
        before = {i: (k[0].clone(), pool.values[i][0].clone()) for i, k in pool.keys.items()}
        t = ring.step_tokens
        rows = torch.full((2,), pool.pad_slot, dtype=torch.long)
        pos = pool.index[-t:].expand(2, t).clone()
        pick = torch.full((2, 1), t - 1, dtype=torch.long)
        shard.run_batch(blank_input(shard, 2, t), pos, BatchView(pool, rows, pos), pick)
        greedy_steps(shard.run_batch, pool, rows, blank_input(shard, 2, t), pos, pick, ring.max_draft)
    for i, (k, v) in before.items():
        assert torch.equal(pool.keys[i][0], k) and torch.equal(pool.values[i][0], v)


def test_rings_cost_less_than_full_slots(shard):
    """A slot's bytes count each windowed layer at its ring: here half the layers at 32 of 272 positions."""
    full = KVPool.slot_bytes(shard, 256, 16)
    ringed = KVPool.slot_bytes(shard, 256, 16, ring_slack=SLACK)
    assert ringed == full // 2 + full // 2 * 80 // 272


def test_the_plan_counts_rings_as_the_pools_hold_them(shard):
    """`shardflow plan` sizes a slot as the engines' pools do: windowed layers at their rings (the engines' slack is
    at least their scratch), the others at every position."""
    shape = model_shape(shard.config, torch.float32)
    assert shape.window_layer == (WINDOW, WINDOW, None, None)
    per = shape.kv_layer[0]
    assert kv_bytes(shape, (0, 4), 256, 16) == 4 * per * 272
    assert kv_bytes(shape, (0, 4), 256, 16, SLACK) == 2 * per * 80 + 2 * per * 272  # 64 + 8 -> 80
    assert kv_bytes(shape, (0, 4), 256, 16, SLACK) == KVPool.slot_bytes(shard, 256, 16, ring_slack=SLACK)
