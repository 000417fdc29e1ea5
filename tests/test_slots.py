"""KV slots in two lengths (workers/engine/sizing.py `plan_slots`, Engine's short and full-length pools): a
sequence that fits a short slot takes one, others a full-length one; both run batched and compute what they
compute alone; the plan splits the device's memory between the two."""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

from schemas.settings import Settings
from workers.engine import sizing
from workers.engine.kvcache import KVCache
from workers.engine.runner import Engine
from workers.engine.shard import load_shard
from workers.engine.sizing import SlotPlan
from workers.speculative.drafters import ModelDrafter, propose_greedy_many


def _seated(gen) -> bool:
    """Whether a generation holds its cache slots (seated, not yet ended)."""
    from workers.head.generation import Phase

    return gen.phase in (Phase.READY, Phase.IN_FLIGHT, Phase.BUSY)


def _engine(models) -> Engine:
    shard = load_shard(models["qwen2"].target, None, embed=True, head=True)
    return Engine(
        shard, Settings(engine={"static": True, "max_len": 64}), step_tokens=4, slots=SlotPlan(2, short=3, short_len=32)
    )


def test_a_sequence_takes_the_shortest_slot_it_fits(models):
    engine = _engine(models)
    assert engine.slots == 5 and [p.max_len for p in engine.pools] == [32, 64]
    assert engine.short_pool is not None and engine.pool is not None
    short = [engine.acquire(need=20) for _ in range(3)]
    assert all(c.pool is engine.short_pool for c in short)
    spill = engine.acquire(need=20)  # short slots taken: a full-length one
    assert spill.pool is engine.pool
    long = engine.acquire(need=40)
    assert long.pool is engine.pool
    assert engine.acquire(overflow=False, need=20) is None and engine.acquire(overflow=False) is None
    extra = engine.acquire(need=20)  # beyond every slot: a one-slot spare pool of the length it needs
    assert extra.pool not in engine.pools and extra.pool.max_len == 32
    engine.release(short[0])
    assert engine.acquire(overflow=False, need=30).pool is engine.short_pool
    assert engine.acquire(overflow=False, need=33) is None  # too long for the free short slot
    engine.release(long)
    assert engine.acquire(overflow=False).pool is engine.pool  # no need given: full length


@torch.inference_mode()
def test_short_and_full_slots_run_as_alone(models):
    """Sequences in both pools, prompts then a round each: every output equals the sequence run alone."""
    engine = _engine(models)
    v = engine.shard.config.vocab_size
    lengths, needs = [10, 20, 7, 15], [20, 50, 30, 60]
    tokens = [torch.arange(5 * i + 1, 5 * i + 1 + n) % v for i, n in enumerate(lengths)]
    caches = [engine.acquire(need=n) for n in needs]
    assert [c.pool.max_len for c in caches] == [32, 64, 32, 64]
    first = engine.forward_many(caches, [x[:-3] for x in tokens], [0] * 4, 2)
    later = engine.forward_many(caches, [x[-3:] for x in tokens], [n - 3 for n in lengths], 3)
    for x, a, b in zip(tokens, first, later, strict=True):
        ref = KVCache()
        assert torch.allclose(a, engine.shard(x[:-3], 0, ref, 2), atol=1e-4, rtol=1e-4)
        assert torch.allclose(b, engine.shard(x[-3:], x.shape[0] - 3, ref, 3), atol=1e-4, rtol=1e-4)


def test_the_plan_splits_memory_between_lengths(monkeypatch):
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=100 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 10 * gib)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (90 * gib, 100 * gib))
    engine = {
        "gpu_memory": 0.5,
        "graph_reserve": 0.1,
        "max_slots": 256,
        "long_slots_share": 0.25,
        "cuda_context_gib": 0,
    }
    cfg = Settings(engine={**engine, "short_cache_min": 2048})  # short slots that never shrink
    dev = torch.device("cuda:0")

    def plan(cost: int, short_cost: int, settings: Settings = cfg, workspace: int = 0) -> SlotPlan:
        one = {8192: cost, 2048: short_cost}
        return sizing.memory_plan([(dev, lambda n: one[n], workspace)], 8192, settings)

    # (50 - 10) * 0.9 = 36 GiB: 9 full-length slots of 1 GiB in a quarter, 108 short ones of 0.25 GiB in the rest
    assert plan(gib, gib // 4) == SlotPlan(9, 108, 2048)
    assert plan(gib, gib // 64) == SlotPlan(9, 247, 2048)  # at most max_slots in all
    assert plan(gib, 0, cfg.replace(engine={"short_cache_len": 0})) == SlotPlan(36)  # full-length slots only
    # a workspace larger than graph_reserve's share is kept instead: (50 - 10) - 8 = 32 GiB
    assert plan(gib, gib // 4, workspace=8 * gib) == SlotPlan(8, 96, 2048)
    assert sizing.short_len_of(8192, cfg) == 2048 and sizing.short_len_of(2048, cfg) == 0
    assert sizing.short_len_of(8192, cfg.replace(engine={"short_cache_len": 0})) == 0


def test_short_slots_shrink_until_max_slots_fit(monkeypatch):
    """Where max_slots do not fit, short slots get shorter (by 256 positions) until they do, down to
    short_cache_min: a batch of short jobs then runs at once rather than in two waves. A head whose drafter has a
    GPU of its own gets what both devices hold, at one short length."""
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=100 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 10 * gib)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (90 * gib, 100 * gib))
    engine = {"gpu_memory": 0.5, "graph_reserve": 0.1, "max_slots": 128, "cuda_context_gib": 0}
    cfg, dev = Settings(engine=engine), torch.device("cuda:0")
    assert sizing.short_lengths(8192, cfg) == [2048, 1792, 1536, 1280, 1024]
    assert sizing.short_lengths(8192, cfg.replace(engine={"short_cache_min": 4096})) == [2048]
    assert sizing.short_lengths(8192, cfg.replace(engine={"short_cache_len": 0})) == [0]

    def cost(n: int) -> int:  # 1 GiB for 8,192 positions
        return gib * n // 8192

    # 36 GiB: 9 + 108 at 2,048 positions; 9 + 123 at 1,792 holds 128
    assert sizing.memory_plan([(dev, cost, 0)], 8192, cfg) == SlotPlan(9, 119, 1792)
    # 256 fit at no length (9 + 216 at 1,024): slots keep their length, where longer jobs fit
    assert sizing.memory_plan([(dev, cost, 0)], 8192, cfg.replace(engine={"max_slots": 256})) == SlotPlan(9, 108, 2048)
    # a drafter's GPU that holds half as many: the fewer of both at the length where both hold 128, 1,024 (where
    # the head alone would stop at 1,792: its drafter's GPU holds 4 + 64 there)
    both = sizing.memory_plan(
        [(dev, cost, 0), (dev, lambda n: 2 * cost(n), 0)], 8192, cfg.replace(engine={"short_cache_min": 512})
    )
    assert both == SlotPlan(4, 124, 768)


def test_the_budget_does_not_count_the_allocators_cached_blocks(monkeypatch):
    """What a load freed into the allocator's cache (a quantized shard's full-precision weights) is given back before
    slots are counted, not held against them."""
    gib = 1 << 30
    reserved = [12 * gib]  # 2 GiB of it cached, free
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=100 * gib))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device", lambda d: nullcontext())
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: reserved.__setitem__(0, 10 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: reserved[0])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (88 * gib, 100 * gib))
    cfg = Settings(engine={"gpu_memory": 20, "graph_reserve": 0.0, "cuda_context_gib": 0})
    assert sizing.budget(torch.device("cuda:0"), cfg) == 10 * gib


@torch.inference_mode()
def test_greedy_drafts_across_both_lengths_equal_drafts_alone(models):
    """Sessions in short and full-length slots drafted together (one whole draft per pool) propose what each
    proposes alone with a growing cache."""
    shard = load_shard(models["qwen2"].drafter, None, embed=True, head=True)
    tiers = Engine(
        shard,
        Settings(engine={"static": True, "max_len": 64}),
        step_tokens=2,
        pad=False,
        max_draft=4,
        slots=SlotPlan(2, 2, 32),
    )
    alone = Engine(shard, Settings(engine={"static": False, "max_len": 64}), step_tokens=2, pad=False, max_draft=4)
    v = shard.config.vocab_size
    contexts = [[(7 * i + j) % v for j in range(n)] for i, n in enumerate((9, 14, 6, 11))]
    needs, ks = [20, 50, 25, 60], [4, 3, 4, 2]
    sessions = [ModelDrafter(shard, tiers).new_session(n) for n in needs]
    assert [s.cache.pool.max_len for s in sessions] == [32, 64, 32, 64]
    got = propose_greedy_many(sessions, contexts, ks)
    for c, k, d in zip(contexts, ks, got, strict=True):
        want = propose_greedy_many([ModelDrafter(shard, alone).new_session()], [c], [k])[0]
        assert d.tokens == want.tokens
    # the next round feeds one or two new tokens: the whole draft per pool (`Engine.draft_many`)
    later = [c + d.tokens[:1] + [5] for c, d in zip(contexts, got, strict=True)]
    calls = []
    run = tiers.draft_many
    tiers.draft_many = lambda caches, *a: calls.append(len(caches)) or run(caches, *a)  # type: ignore[method-assign]
    got = propose_greedy_many(sessions, later, ks)
    assert calls == [2, 2]  # one per pool
    for c, k, d in zip(later, ks, got, strict=True):
        want = propose_greedy_many([ModelDrafter(shard, alone).new_session()], [c], [k])[0]
        assert d.tokens == want.tokens


def test_generations_longer_than_the_free_slots_wait_for_one(models, hf_models, tokenizers, tails, redis_client):
    """A head whose short slots its jobs do not fit runs them through its full-length slots one after another,
    as those free, rather than in spare pools beyond its memory plan; each equals HF `generate`."""
    from schemas.requests import GenerationRequest
    from tests.conftest import PROMPTS
    from tests.job_env import SPLIT, reference
    from workers.head.runtime import HeadRuntime, new_generation

    ms = models["qwen2"]
    names = tails.get(ms.target, SPLIT, ms.n_layers)
    cfg = Settings(engine={"cpu_slots": 4, "long_slots_share": 0.5, "max_len": 64, "short_cache_len": 32})
    runtime = HeadRuntime.load(ms.target, (0, SPLIT), draft=ms.drafter, settings=cfg)
    assert [(p.slots, p.max_len) for p in runtime.engine.pools] == [(2, 32), (2, 64)]
    reqs = [GenerationRequest(prompt=p, chat_template=False, max_new_tokens=20) for p in PROMPTS[:5]]
    gens = [new_generation(req, runtime, redis_client, names=names) for req in reqs]
    assert all(g.need > 32 and not _seated(g) for g in gens)  # none fits a short slot
    loop = runtime.loop_for(redis_client)
    futures = [loop.submit(g) for g in gens]
    results = [f.result(timeout=120) for f in futures]
    want = [reference(hf_models["qwen2"], tokenizers["qwen2"], p, 20) for p in PROMPTS[:5]]
    assert [r.token_ids for r in results] == want
    assert runtime.engine._spare == [] and runtime.draft_model.engine._spare == []  # no pool beyond the plan
    assert not any(_seated(g) for g in gens)  # every slot given back


def test_a_draft_model_with_no_free_slot_says_so_rather_than_growing(models):
    """Asked without overflow, a draft model whose pools are taken raises NoFreeSlot (its head's loop seats the
    generation later) instead of making a spare pool beyond the memory plan."""
    import pytest

    from workers.speculative.drafters import NoFreeSlot

    shard = load_shard(models["qwen2"].drafter, None, embed=True, head=True)
    engine = Engine(shard, Settings(engine={"static": True, "max_len": 64}), step_tokens=2, slots=SlotPlan(1))
    drafter = ModelDrafter(shard, engine)
    first = drafter.new_session(40, overflow=False)
    with pytest.raises(NoFreeSlot):
        drafter.new_session(40, overflow=False)
    assert engine._spare == []
    first.close()
    drafter.new_session(40, overflow=False).close()  # free again


def test_a_generation_cancelled_while_it_waits_for_a_slot_ends_then(models, hf_models, tokenizers, tails, redis_client):
    """A generation waiting for a full-length slot that its job's user cancels (the dispatcher's heartbeat sees the
    cancel key: no verdict yet, so no progress flush would) ends at once with why, holding nothing; the others run
    on, each equal to HF `generate`."""
    import time

    from schemas.requests import GenerationRequest
    from tests.conftest import PROMPTS
    from tests.job_env import SPLIT, reference
    from workers.head.jobs.progress import JobCancelled
    from workers.head.runtime import HeadRuntime, new_generation

    ms = models["qwen2"]
    names = tails.get(ms.target, SPLIT, ms.n_layers)
    cfg = Settings(engine={"cpu_slots": 4, "long_slots_share": 0.5, "max_len": 64, "short_cache_len": 32})
    runtime = HeadRuntime.load(ms.target, (0, SPLIT), draft=ms.drafter, settings=cfg)
    reqs = [GenerationRequest(prompt=p, chat_template=False, max_new_tokens=30) for p in PROMPTS[:3]]
    gens = [new_generation(req, runtime, redis_client, names=names) for req in reqs]
    loop = runtime.loop_for(redis_client)
    futures = [loop.submit(g) for g in gens]  # two full-length slots: the third waits
    deadline = time.monotonic() + 30
    while not (_seated(gens[0]) and _seated(gens[1])):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    t0 = time.monotonic()
    loop.cancel(futures[2], JobCancelled("cancelled by its user while waiting for a cache slot"))
    loop.cancel(futures[0], JobCancelled("never seen: seated already, it ends at a progress flush"))
    with pytest.raises(JobCancelled, match="waiting for a cache slot"):
        futures[2].result(timeout=30)
    assert time.monotonic() - t0 < 5  # at once, not once a slot frees (the seated one ends as asked, below)
    assert not _seated(gens[2])
    want = [reference(hf_models["qwen2"], tokenizers["qwen2"], p, 30) for p in PROMPTS[:2]]
    assert [f.result(timeout=120).token_ids for f in futures[:2]] == want
    assert not any(_seated(g) for g in gens)


@pytest.mark.slow  # 16 s here: a second loop's threads and reply stream
def test_a_slot_freed_on_one_loop_seats_a_generation_waiting_on_another(
    models, hf_models, tokenizers, tails, redis_client, redis_server
):
    """A head runs a loop per Redis connection over one set of cache slots: a generation waiting on one loop is seated
    when a generation on another ends (it waited for a timeout it may not have before)."""
    from relay_broker.connection import connect
    from schemas.requests import GenerationRequest
    from tests.conftest import PROMPTS
    from tests.job_env import SPLIT, reference
    from workers.head.runtime import HeadRuntime, new_generation

    ms = models["qwen2"]
    names = tails.get(ms.target, SPLIT, ms.n_layers)
    cfg = Settings(engine={"cpu_slots": 4, "long_slots_share": 0.5, "max_len": 64, "short_cache_len": 32})
    runtime = HeadRuntime.load(ms.target, (0, SPLIT), draft=ms.drafter, settings=cfg)
    other = connect(redis_server.url)
    reqs = [GenerationRequest(prompt=p, chat_template=False, max_new_tokens=20) for p in PROMPTS[:3]]
    conns = [redis_client, redis_client, other]
    gens = [new_generation(req, runtime, r, names=names) for req, r in zip(reqs, conns, strict=True)]
    futures = [runtime.loop_for(redis_client).submit(g) for g in gens[:2]]  # both full-length slots
    futures.append(runtime.loop_for(other).submit(gens[2]))  # no timeout: only a freed slot seats it
    want = [reference(hf_models["qwen2"], tokenizers["qwen2"], p, 20) for p in PROMPTS[:3]]
    assert [f.result(timeout=120).token_ids for f in futures] == want
    assert not any(_seated(g) for g in gens)
