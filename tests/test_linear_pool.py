"""Linear-attention layers over static pools (workers/engine/linear_pool.py): batches of sequences in one forward,
each row at its own position with its own drafts, equal the unsplit model; a rejected round leaves a slot's states
bit for bit as they were; a rollback past what the pool keeps is refused; a released slot starts from nothing."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from schemas.settings import Settings
from workers.engine.runner import Engine
from workers.engine.shard import load_shard
from workers.tiny_models import HYBRID_FAMILIES, save_tiny_model

STATIC = Settings(engine={"static": True, "slots": 4})


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("linear_pool")
    return {f: save_tiny_model(root / f, f) for f in HYBRID_FAMILIES}


def _engines(target, split: int) -> tuple[Engine, Engine]:
    head = load_shard(target, (0, split), embed=True, head=False)
    tail = load_shard(target, (split, 4), embed=False, head=True)
    return Engine(head, STATIC), Engine(tail, STATIC)


def _slot(cache) -> list[torch.Tensor]:
    lin = cache.pool.linear
    return [t[cache.slot].clone() for t in lin.tensors()]


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
@pytest.mark.parametrize("split", [1, 3])  # a head of linear layers, a tail of both / a tail of attention alone
def test_batched_rounds_with_rollbacks_equal_the_model(family, split, models):
    """Three sequences: prompts as one batch (longer than the ring: their first tokens commit at once), then rounds
    of 2-5 tokens a row (rows padded to the longest), a random number of drafts kept each time."""
    target, rng = models[family], random.Random(split)
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    head, tail = _engines(target, split)
    seqs = [[rng.randrange(100) for _ in range(n)] for n in (6, 14, 21)]
    caches = [(head.acquire(), tail.acquire()) for _ in seqs]
    with torch.inference_mode():
        hs = head.forward_many([c[0] for c in caches], [torch.tensor(s[:-1]) for s in seqs], [0] * 3)
        tail.forward_many([c[1] for c in caches], hs, [0] * 3)
        for _ in range(5):
            lens = [len(s) - 1 for s in seqs]
            xs = [[s[-1]] + [rng.randrange(100) for _ in range(rng.randint(1, 4))] for s in seqs]
            hs = head.forward_many([c[0] for c in caches], [torch.tensor(x) for x in xs], lens)
            got = tail.forward_many([c[1] for c in caches], hs, lens, [len(x) for x in xs])
            for s, x, logits, (hc, tc) in zip(seqs, xs, got, caches, strict=True):
                want = hf(torch.tensor([s + x[1:]])).logits[0, len(s) - 1 :]
                torch.testing.assert_close(logits, want, rtol=1e-3, atol=1e-3)
                s.extend(x[1 : 1 + rng.randint(0, len(x) - 1)] + [rng.randrange(100)])
                hc.crop(len(s) - 1)
                tc.crop(len(s) - 1)


def test_a_rejected_round_leaves_the_slot_exactly_as_before(models):
    """A round that commits nothing (all it and the prompt hold fit the ring), rolled back: the slot's base, states
    and the ring's kept inputs bit for bit as before, and the next round's logits bit for bit those of a cache that
    never saw it. Then with a full ring (a longer prompt: rounds commit its oldest tokens), 2 of 6 kept continue as a
    cache fed only those 2 would."""
    engine = Engine(load_shard(models["qwen3_5_text"], None, embed=True, head=True), STATIC)
    kept, rejected, nxt = torch.tensor([7, 8]), torch.tensor([9, 10, 11, 12]), torch.tensor([3, 4, 5])
    with torch.inference_mode():
        cache, clean = engine.acquire(), engine.acquire()
        lin = cache.pool.linear
        for c in (cache, clean):
            engine.forward(c, torch.arange(5, 9), 0)
        before = _slot(cache)
        engine.forward(cache, torch.cat([kept, rejected]), 4, logits_last=6)
        cache.crop(4)
        after = _slot(cache)
        rings = len(lin.inputs)
        assert all(torch.equal(a, b) for a, b in zip(after[:-rings], before[:-rings], strict=True))
        assert all(torch.equal(a[:4], b[:4]) for a, b in zip(after[-rings:], before[-rings:], strict=True))
        got = engine.forward(cache, nxt, 4, logits_last=3).clone()
        assert torch.equal(got, engine.forward(clean, nxt, 4, logits_last=3))

        long, short = engine.acquire(), engine.acquire()
        for c in (long, short):
            engine.forward(c, torch.arange(5, 25), 0)
        engine.forward(long, torch.cat([kept, rejected]), 20, logits_last=6)
        long.crop(22)
        engine.forward(short, kept, 20)
        torch.testing.assert_close(
            engine.forward(long, nxt, 22, logits_last=3).clone(),
            engine.forward(short, nxt, 22, logits_last=3),
            rtol=1e-4,
            atol=1e-4,
        )


def test_a_rollback_past_the_ring_is_refused_and_a_released_slot_is_zeroed(models):
    shard = load_shard(models["qwen3_next"], (0, 2), embed=True, head=False)
    engine = Engine(shard, STATIC)
    cache = engine.acquire()
    depth = cache.pool.linear.depth
    with torch.inference_mode():
        engine.forward(cache, torch.arange(depth + 6), 0)
    cache.crop(7)  # within the ring
    with pytest.raises(ValueError, match="keep only the last"):
        cache.crop(5)
    slot = cache.slot
    engine.release(cache)
    assert all(not t[slot].any() for t in cache.pool.linear.tensors())
