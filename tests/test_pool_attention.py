"""Attention over a KV pool in place (workers/engine/pool_attention.py), on this CPU through its reference kernel:
the layout's offsets, lengths and causal alignment give what the gathered path gives, for single tokens (draft
steps: query heads folded), several tokens a row (rounds, prompts), rows in any slot order, padding rows, and
positions past 2,048; a whole draft over the pool equals one over a `DraftBuffer`, slots included. GPU: the
FlashAttention kernel is checked against `reference` at load (`supported`'s probe), and the job path's greedy
outputs against the no-speculation reference (docs/runs/journal.md runs 56-59)."""

from __future__ import annotations

import pytest
import torch

from workers.engine import pool_attention
from workers.engine.fused import attend as gathered_attend
from workers.engine.graphs import greedy_steps
from workers.engine.kvcache import BatchView, KVCache, KVPool
from workers.engine.shard import load_shard


@pytest.mark.parametrize(("t", "split"), [(1, False), (3, False), (9, False), (3, True), (9, True), (2, True)])
def test_reference_layout_equals_gathered_attention(t, split, monkeypatch):
    """Rows in slots 3, 0, 2 (and the pad slot) with their last tokens at different positions, grouped-query heads:
    in place equals a gather of the rows' slots with the causal mask (float32), one head at a time or a round's
    rows split at its first token and merged."""
    monkeypatch.setattr(pool_attention, "SPLIT_MIN_BATCH", 1 if split else 1 << 20)
    torch.manual_seed(0)
    slots, hkv, g, d, length = 4, 2, 3, 16, 40
    keys = torch.randn(slots + 1, hkv, length, d)
    values = torch.randn(slots + 1, hkv, length, d)
    rows = torch.tensor([3, 0, 2, slots])
    last = torch.tensor([t + 4, 30, t - 1, length - 1])
    q = torch.randn(4, t, hkv * g, d)
    lay = pool_attention.layout(rows, last, t, hkv, g, length)
    assert lay.mode == ("fold" if t == 1 else "split" if split else "heads")
    pos = last[:, None] - t + 1 + torch.arange(t)
    new = tuple(c[rows[:, None], :, pos].transpose(1, 2) for c in (keys, values))  # this step's, in the pool
    got = pool_attention.attend(q, keys, values, lay, 0.25, pool_attention.reference, new)
    mask = (torch.arange(length)[None, None] <= pos[:, :, None])[:, None]  # [B, 1, T, L]
    bias = torch.where(mask, 0.0, -torch.inf)
    b, hq = 4, hkv * g
    full = bias[:, :, None].expand(b, hkv, g, t, length).reshape(-1, g * t, length)
    want = gathered_attend(q, keys[rows], values[rows], full, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got.shape == (b * t, hq * d)


@pytest.mark.parametrize("t", [1, 3, 9])
def test_long_rows_read_in_chunks_equal_gathered_attention(t, monkeypatch):
    """A batch's rounds whose rows may reach past LONG_REACH read their keys in chunks merged by log-sum-exp
    (split-KV): equal to a gather of the rows' slots, rows of a few keys to all of them (chunks left empty), a padding
    row reading t keys rather than its slot's scratch; draft steps read whole rows."""
    monkeypatch.setattr(pool_attention, "LONG_REACH", 16)
    monkeypatch.setattr(pool_attention, "CHUNK_MIN_KEYS", 5)
    monkeypatch.setattr(pool_attention, "SPLIT_MIN_BATCH", 4)
    torch.manual_seed(2)
    slots, hkv, g, d, length = 4, 2, 3, 16, 64
    keys = torch.randn(slots + 1, hkv, length, d)
    values = torch.randn(slots + 1, hkv, length, d)
    rows = torch.tensor([3, 0, 2, slots])
    last = torch.tensor([t + 2, 60, 33, length - 1])
    q = torch.randn(4, t, hkv * g, d)
    lay = pool_attention.layout(rows, last, t, hkv, g, length, reach=62, pad=slots)
    chunks = 1 if t == 1 else 13
    assert lay.mode == ("fold" if t == 1 else "split") and lay.chunks == chunks
    assert lay.used.view(4, hkv, chunks)[3].sum(-1).tolist() == [t] * hkv  # the padding row: t keys
    pos = last[:, None] - t + 1 + torch.arange(t)
    new = tuple(c[rows[:, None], :, pos].transpose(1, 2) for c in (keys, values))
    got = pool_attention.attend(q, keys, values, lay, 0.25, pool_attention.reference, new)
    mask = (torch.arange(length)[None, None] <= pos[:, :, None])[:, None]
    bias = torch.where(mask, 0.0, -torch.inf)
    full = bias[:, :, None].expand(4, hkv, g, t, length).reshape(-1, g * t, length)
    want = gathered_attend(q, keys[rows], values[rows], full, 0.25)
    torch.testing.assert_close(got.view(4, t, -1)[:3], want.view(4, t, -1)[:3], rtol=1e-5, atol=1e-5)
    assert pool_attention.layout(rows, last, t, hkv, g, length, reach=16).chunks == 1
    assert pool_attention.chunks_agree(pool_attention.reference, torch.device("cpu"), torch.float32, d)  # the probe's


def _shards(models):
    path = models["qwen2"].target
    in_place = load_shard(path, None, embed=True, head=True)
    gather = load_shard(path, None, embed=True, head=True)
    in_place.set_attention("in_place")
    assert in_place.attends_in_place and not gather.attends_in_place
    return in_place, gather


@pytest.mark.parametrize("split", [False, True])
@torch.inference_mode()
def test_batches_in_place_equal_gathered_batches_past_2048_positions(models, split, monkeypatch):
    """Prompts, then a round of 4 tokens a row and one-token steps over the same pool contents: slots in any order,
    a padding row, one row past 2,048 positions; the sequence's cache also equals a growing (HF-style) cache's."""
    monkeypatch.setattr(pool_attention, "SPLIT_MIN_BATCH", 1 if split else 1 << 20)
    a, b = _shards(models)
    torch.manual_seed(1)
    vocab = a.config.vocab_size
    pools = [KVPool.for_shard(s, slots=3, max_len=2600, scratch=8) for s in (a, b)]
    prompts = {2: 2500, 0: 37, 1: 5}  # slot -> prompt length
    ids = {s: torch.randint(0, vocab, (n + 4,)) for s, n in prompts.items()}
    for shard, pool in zip((a, b), pools, strict=True):
        for s, n in prompts.items():
            pos = torch.arange(n)[None]
            shard.run_batch(ids[s][None, :n], pos, BatchView(pool, torch.tensor([s]), pos))
    for i in pools[0].keys:  # the prompts left the same keys in both pools
        torch.testing.assert_close(pools[0].keys[i], pools[1].keys[i], rtol=1e-4, atol=1e-4)
    order = [2, 0, 1]
    rows = torch.tensor([*order, pools[0].pad_slot])
    pos = torch.stack([torch.arange(prompts[s], prompts[s] + 4) for s in order] + [pools[0].index[-4:]])
    x = torch.stack([ids[s][prompts[s] :] for s in order] + [torch.zeros(4, dtype=torch.long)])
    got, want = (s.run_batch(x, pos, BatchView(p, rows, pos), None) for s, p in zip((a, b), pools, strict=True))
    torch.testing.assert_close(got[:3], want[:3], rtol=1e-4, atol=1e-4)
    step = pos[:, -1:] + torch.tensor([[1], [1], [1], [0]])
    nxt = torch.randint(0, vocab, (4, 1))
    got, want = (s.run_batch(nxt, step, BatchView(p, rows, step), None) for s, p in zip((a, b), pools, strict=True))
    torch.testing.assert_close(got[:3], want[:3], rtol=1e-4, atol=1e-4)
    grow = KVCache()  # slot 2's whole sequence through a growing cache (no pool at all)
    seq = torch.cat([ids[2], nxt[0]])
    ref = b(seq, 0, grow)
    torch.testing.assert_close(got[0, 0], ref[-1], rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_one_sequence_forward_in_place_equals_its_slot(models):
    """`Shard.forward` over one static slot (a sequence run alone) attends in place too."""
    a, b = _shards(models)
    x = torch.randint(0, a.config.vocab_size, (50,))
    outs = []
    for shard in (a, b):
        pool = KVPool.for_shard(shard, slots=2, max_len=128, scratch=8)
        cache = pool.acquire()
        steps = [shard(x[:40], 0, cache, 40), shard(x[40:41], 40, cache, 1), shard(x[41:], 41, cache, 9)]
        outs.append(torch.cat(steps))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_a_draft_in_place_equals_a_draft_over_a_copy(models):
    """A whole greedy draft over the pool itself proposes the tokens a DraftBuffer draft proposes and leaves the
    real rows' slots holding the same keys and values."""
    path = models["qwen2"].drafter
    a, b = load_shard(path, None, embed=True, head=True), load_shard(path, None, embed=True, head=True)
    a.set_attention("in_place")
    torch.manual_seed(2)
    pools = [KVPool.for_shard(s, slots=4, max_len=64, scratch=12) for s in (a, b)]
    for s, n in ((0, 5), (2, 11), (3, 20)):
        prompt = torch.randint(0, a.config.vocab_size, (1, n))
        pos = torch.arange(n)[None]
        for shard, pool in zip((a, b), pools, strict=True):
            shard.run_batch(prompt, pos, BatchView(pool, torch.tensor([s]), pos))
    t = 2
    rows = torch.tensor([0, 2, 3, pools[0].pad_slot])
    pos = torch.tensor([[5, 6], [11, 12], [20, 21], pools[0].index[-t:].tolist()])
    x = torch.tensor([[7, 9], [3, 0], [4, 8], [0, 0]])
    pick = torch.tensor([[1], [0], [1], [t - 1]])
    got = greedy_steps(a.run_batch, pools[0], rows, x, pos, pick, 6, None, in_place=True)
    want = greedy_steps(b.run_batch, pools[1], rows, x, pos, pick, 6, None)
    assert torch.equal(got[:3], want[:3])
    for i in pools[0].keys:
        for slot in (0, 2, 3):
            n = {0: 5 + 2 + 5, 2: 11 + 1 + 6, 3: 20 + 2 + 5}[slot]  # prompt, feed, drafts written
            torch.testing.assert_close(pools[0].keys[i][slot, :, :n], pools[1].keys[i][slot, :, :n])
            torch.testing.assert_close(pools[0].values[i][slot, :, :n], pools[1].values[i][slot, :, :n])
