"""Drafters: the draft model's cache re-syncs exactly (the full-hit bug of ShardFlow v2.1, the public
split-inference system this project is measured against: after a round that accepted every draft, its
drafter never consumed the last one), n-gram lookup, and the tail's session store bounds."""

from __future__ import annotations

import time

import pytest
import torch

from schemas.errors import InvalidRequest, ModelLoadError
from schemas.requests import DraftSettings, GenerationRequest, SamplingParams
from schemas.settings import Settings
from tests.conftest import PROMPTS
from workers.engine.kvcache import KVCache
from workers.engine.shard import load_shard
from workers.head.runtime import HeadRuntime, generate
from workers.plugins import DrafterContext, Registry, load_plugins
from workers.speculative.drafters import Draft, ModelDrafter, NgramDrafter
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


class ReplayDrafter:
    """A plugin drafter (this module is its plugin: see `register`): proposes `options["ids"]`, the
    continuation to expect, with every `options["wrong_every"]`-th token wrong; it runs the head's draft
    model session only to pay its cost, as bench/synthetic.py's does."""

    device = torch.device("cpu")

    def __init__(self, options: dict, ctx: DrafterContext) -> None:
        self.ids, self.every, self.ctx = list(options["ids"]), int(options.get("wrong_every", 0)), ctx

    @property
    def model_session(self):
        return self.ctx.model_session

    def propose(self, context: list[int], k: int, sampling: SamplingParams, gen: torch.Generator) -> Draft:
        return self.finish(Draft([]), context, k, gen)

    def finish(self, draft: Draft, context: list[int], k: int, gen: torch.Generator | None) -> Draft:
        at = len(context) - self.ctx.prompt_len
        want = self.ids[at : at + k]
        wrong = [self.every > 0 and (at + i) % self.every == self.every - 1 for i in range(len(want))]
        return Draft([(t + 1) % self.ctx.vocab_size if w else t for t, w in zip(want, wrong, strict=True)], point=True)

    def close(self) -> None:
        if self.ctx.model_session is not None:
            self.ctx.model_session.close()


def register(registry: Registry) -> None:
    """This test module as a plugin (workers/plugins.py): a `replay` drafter kind."""
    registry.add_drafter("replay", ReplayDrafter)


def test_plugin_drafter_runs_only_where_loaded_and_stays_lossless(models, tails, redis_client, tokenizers):
    """A drafter kind from a plugin module (`--plugin`, load_plugins) serves requests naming it, batched
    with the draft model, lossless at any acceptance; a head without the plugin refuses the request with
    the reason; a bad plugin name or module is a clear load error."""
    ms = models["qwen2"]
    names = tails.get(ms.target, 2, ms.n_layers)
    runtime = HeadRuntime.load(ms.target, (0, 2), draft=ms.drafter, plugins=load_plugins([__name__]))
    prompt = tokenizers["qwen2"].encode(PROMPTS[3])
    base = GenerationRequest(prompt_ids=prompt, max_new_tokens=40, draft=DraftSettings(kind="none"))
    ref = generate(base, runtime, redis_client, names=names).token_ids
    replay = DraftSettings(kind="replay", k=6, adaptive=False, options={"ids": ref})
    with pytest.raises(InvalidRequest, match="drafter kind 'replay' is not available on this worker"):
        generate(base.model_copy(update={"draft": replay}), HeadRuntime.load(ms.target, (0, 2)), redis_client)
    for every, check in (
        (0, lambda r: r.accepted_tokens == r.drafted_tokens),
        (1, lambda r: r.accepted_tokens == 0),
        (3, lambda r: 0 < r.accepted_tokens < r.drafted_tokens),
    ):
        draft = replay.model_copy(update={"options": {"ids": ref, "wrong_every": every}})
        got = generate(base.model_copy(update={"draft": draft}), runtime, redis_client, names=names)
        assert got.token_ids == ref and check(got), (every, got.accepted_tokens, got.drafted_tokens)
    with pytest.raises(ModelLoadError, match="cannot be imported"):
        load_plugins(["no_such_module_here"])
    with pytest.raises(ModelLoadError, match="has no register"):
        load_plugins(["json"])
    with pytest.raises(ModelLoadError, match="needs a plugin"):
        HeadRuntime.load("random:tiny", (0, 2))


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
    runtime = HeadRuntime.load(ms.target, (0, 2), draft=ms.drafter, settings=Settings(engine={"static": True}))
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
    from workers.speculative.adaptive import DraftLength, best_k, expected_tokens

    assert expected_tokens(0.78, 8) == pytest.approx(4.06, abs=0.01)  # ShardFlow v2.1 (public) reported 4.07
    assert best_k(0.95, fixed_ms=90, per_draft_ms=3, k_max=16) == 16  # cheap drafts, long round trip
    assert best_k(0.2, fixed_ms=10, per_draft_ms=5, k_max=16) == 1  # poor drafts cost more than they give
    length = DraftLength(k_max=8)
    for _ in range(10):
        k = length.update(drafted=length.k, accepted=0, draft_ms=4.0 * length.k, other_ms=20.0)
    assert k == 1


def test_draft_length_stays_at_its_most_where_k_costs_nothing():
    """With graphs a round costs the same whatever its K (the longest draft runs for every row, rows are padded
    to K + 1): a shorter draft only commits fewer tokens, so the length never drops (here it did, to 1, above)."""
    from workers.speculative.adaptive import DraftLength

    length = DraftLength(k_max=8)
    for _ in range(10):
        k = length.update(drafted=length.k, accepted=0, draft_ms=14.0, other_ms=95.0, free=True)
    assert k == 8


def test_a_graph_round_counts_as_free_of_k(models):
    """The batcher marks rounds run through graphs as free of K (workers/head/batching.py); eager ones not."""
    from workers.engine.runner import Engine
    from workers.engine.shard import load_shard
    from workers.head.batching import _k_free
    from workers.head.drafts import HeadWork

    shard = load_shard(models["qwen2"].target, (0, 1), embed=True, head=False)
    w = HeadWork(None, [1, 2], 4, SamplingParams(), None, None, [2], 1)  # type: ignore[arg-type]
    eager = Engine(shard, Settings(engine={"static": True, "graphs": False}))
    assert not _k_free(w, eager)
    eager.graphs = True  # as a CUDA engine says it (an n-gram or no drafter: only the shard's rows count)
    assert _k_free(w, eager)


def test_common_prefix_equals_a_token_by_token_scan():
    """A session's plan finds the cache's usable prefix by comparing slices (workers/speculative/drafters.py)."""
    import random

    from workers.speculative.drafters import common_prefix

    def scan(a: list[int], b: list[int], limit: int) -> int:
        keep = 0
        while keep < limit and a[keep] == b[keep]:
            keep += 1
        return keep

    rng = random.Random(0)
    for _ in range(3000):
        a = [rng.randint(0, 3) for _ in range(rng.randint(0, 40))]
        b = a[: rng.randint(0, len(a))] + [rng.randint(0, 3) for _ in range(rng.randint(0, 10))]
        limit = rng.randint(0, min(len(a), len(b)))
        assert common_prefix(a, b, limit) == scan(a, b, limit) == common_prefix(b, a, limit)
