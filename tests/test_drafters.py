"""Drafters: the draft model's cache re-syncs exactly (the reference system's full-hit bug), n-gram lookup,
and the tail's session store bounds."""

from __future__ import annotations

import time

import pytest
import torch

from schemas.errors import InvalidRequest
from schemas.requests import DraftSettings, GenerationRequest, SamplingParams
from tests.conftest import PROMPTS
from workers.engine.kvcache import KVCache
from workers.engine.shard import load_shard
from workers.head.runtime import HeadRuntime, generate
from workers.spec.drafters import ModelDrafter, NgramDrafter
from workers.tail.sessions import SessionStore

GREEDY = SamplingParams()


def test_model_drafter_resyncs_after_full_hit_and_rejection(models, tokenizers):
    ms = models["qwen2"]
    drafter = ModelDrafter(load_shard(ms.drafter, None, embed=True, head=True))
    gen = torch.Generator()
    ctx = tokenizers["qwen2"].encode(PROMPTS[0])
    live = drafter.new_session()
    first = live.propose(ctx, 4, GREEDY, gen).tokens
    for committed in (ctx + first + [7], ctx + first[:2] + [9]):  # full hit + bonus; rejection + correction
        again = live.propose(committed, 4, GREEDY, gen).tokens
        fresh = drafter.new_session().propose(committed, 4, GREEDY, gen).tokens
        assert again == fresh
        assert live.cache.length == len(committed) + 3  # context + all drafts but the last
        live.propose(ctx, 4, GREEDY, gen)  # rewind for the next case


def test_exact_copy_drafter_is_always_accepted(models, tails, redis_client):
    """With the target itself as drafter, every draft must be accepted: no cache holes after full hits."""
    ms = models["qwen2"]
    names = tails.get(ms.target, 2, ms.n_layers)
    runtime = HeadRuntime.load(ms.target, (0, 2), draft=ms.same)
    for prompt in PROMPTS[:5]:
        req = GenerationRequest(
            prompt=prompt, max_new_tokens=25, chat_template=False, draft=DraftSettings(k=4, adaptive=False)
        )
        got = generate(req, runtime, redis_client, names=names)
        assert got.accepted_tokens == got.drafted_tokens > 0
        assert got.rounds == 5 or got.finish_reason == "eos"


def test_ngram_drafter_copies_latest_match():
    d = NgramDrafter(ngram_max=3, ngram_min=1)
    gen = torch.Generator()
    assert d.propose([1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3], 2, GREEDY, gen).tokens == [5, 6]
    assert d.propose([5, 1, 7, 7, 1], 3, GREEDY, gen).tokens == [7, 7, 1]
    assert d.propose([1, 2, 3], 3, GREEDY, gen).tokens == []
    assert d.propose([4], 3, GREEDY, gen).point


def test_session_store_bounds_count_and_idle_time():
    store = SessionStore(max_sessions=2, ttl_s=0.05)
    store.open("a", KVCache()), store.open("b", KVCache())
    store.get("a")
    store.open("c", KVCache())  # "b" is least recently used
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    time.sleep(0.08)
    store.expire()
    assert len(store) == 0


def test_synthetic_drafter_sets_acceptance_and_stays_lossless(models, tails, redis_client, tokenizers):
    ms = models["qwen2"]
    names = tails.get(ms.target, 2, ms.n_layers)
    runtime = HeadRuntime.load(ms.target, (0, 2), synthetic_drafts=True)  # a benchmark switch
    prompt = tokenizers["qwen2"].encode(PROMPTS[3])
    base = GenerationRequest(prompt_ids=prompt, max_new_tokens=40, draft=DraftSettings(kind="none"))
    ref = generate(base, runtime, redis_client, names=names).token_ids
    synthetic = base.model_copy(update={"draft": DraftSettings(kind="synthetic", k=6, alpha=1.0, reference_ids=ref)})
    with pytest.raises(InvalidRequest, match="synthetic drafter is for benchmarks"):  # a production head refuses
        generate(synthetic, HeadRuntime.load(ms.target, (0, 2)), redis_client, names=names)
    for alpha, check in (
        (1.0, lambda r: r.accepted_tokens == r.drafted_tokens),
        (0.0, lambda r: r.accepted_tokens == 0),
        (0.7, lambda r: 0 < r.accepted_tokens < r.drafted_tokens),
    ):
        req = base.model_copy(update={"draft": DraftSettings(kind="synthetic", k=6, alpha=alpha, reference_ids=ref)})
        got = generate(req, runtime, redis_client, names=names)
        assert got.token_ids == ref and check(got), (alpha, got.accepted_tokens, got.drafted_tokens)


def test_adaptive_draft_length_shrinks_on_rejections_and_stays_lossless(models, tails, redis_client):
    ms = models["qwen2"]
    names = tails.get(ms.target, 2, ms.n_layers)
    noisy = HeadRuntime.load(ms.target, (0, 2), draft=ms.drafter)
    same = HeadRuntime.load(ms.target, (0, 2), draft=ms.same)
    drafted = {}
    for adaptive in (False, True):
        req = GenerationRequest(
            prompt=PROMPTS[6], max_new_tokens=30, chat_template=False, draft=DraftSettings(k=8, adaptive=adaptive)
        )
        got = generate(req, noisy, redis_client, names=names)
        drafted[adaptive] = (got.token_ids, got.drafted_tokens, got.accepted_tokens)
    assert drafted[True][0] == drafted[False][0]
    assert drafted[True][1] < drafted[False][1]  # fewer wasted drafts once rejections start
    full = generate(
        GenerationRequest(prompt=PROMPTS[6], max_new_tokens=30, chat_template=False, draft=DraftSettings(k=6)),
        same,
        redis_client,
        names=names,
    )
    assert full.accepted_tokens == full.drafted_tokens > 0  # every draft of an exact copy accepted


def test_generations_in_flight_share_a_runtime(models, tails, redis_client, hf_models, tokenizers):
    """Several generations running concurrently on one head runtime each give generate()'s tokens."""
    from concurrent.futures import ThreadPoolExecutor

    ms = models["llama"]
    names = tails.get(ms.target, 2, ms.n_layers, ("--static-cache",))
    runtime = HeadRuntime.load(ms.target, (0, 2), draft=ms.drafter, static=True)
    reqs = [
        GenerationRequest(prompt=p, max_new_tokens=16, chat_template=False, draft=DraftSettings(k=4))
        for p in PROMPTS[:8]
    ]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda q: generate(q, runtime, redis_client, names=names).token_ids, reqs))
    tok, hf = tokenizers["llama"], hf_models["llama"]
    for p, ids in zip(PROMPTS[:8], got, strict=True):
        x = torch.tensor([tok.encode(p)])
        assert (
            ids
            == hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=16)[
                0, x.shape[1] :
            ].tolist()
        )


def test_best_k_follows_acceptance_and_costs():
    from workers.spec.adaptive import DraftLength, best_k, expected_tokens

    assert expected_tokens(0.78, 8) == pytest.approx(4.06, abs=0.01)  # the reference system's 4.07
    assert best_k(0.95, fixed_ms=90, per_draft_ms=3, k_max=16) == 16  # cheap drafts, long round trip
    assert best_k(0.2, fixed_ms=10, per_draft_ms=5, k_max=16) == 1  # poor drafts cost more than they give
    length = DraftLength(k_max=8)
    for _ in range(10):
        k = length.update(drafted=length.k, accepted=0, draft_ms=4.0 * length.k, other_ms=20.0)
    assert k == 1
