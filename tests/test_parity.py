"""Greedy parity: head and tail in separate processes over real Redis equal HF `generate`."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from schemas.requests import DraftSettings, GenerationRequest
from schemas.settings import Settings
from tests.conftest import PROMPTS
from workers.head.runtime import HeadRuntime, generate

NEW = 20
_refs: dict[str, list[list[int]]] = {}
_heads: dict[tuple, HeadRuntime] = {}


def reference(family: str, hf, tokenizer) -> list[list[int]]:
    if family not in _refs:
        outs = []
        for p in PROMPTS:
            ids = torch.tensor([tokenizer.encode(p)])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW)
            outs.append(out[0, ids.shape[1] :].tolist())
        _refs[family] = outs
    return _refs[family]


def head_for(ms, split: int, draft) -> HeadRuntime:
    key = (str(ms.target), split, str(draft))
    if key not in _heads:
        _heads[key] = HeadRuntime.load(ms.target, (0, split), draft=draft)
    return _heads[key]


def test_references_vary(models, hf_models, tokenizers):
    """The tiny targets' greedy outputs are varied, so parity is a meaningful check."""
    for family in models:
        outs = reference(family, hf_models[family], tokenizers[family])
        assert len({tuple(o) for o in outs}) >= 15
        assert all(len(set(o)) >= 5 for o in outs[:10])


@pytest.mark.parametrize("family", ["qwen2", "llama"])
@pytest.mark.parametrize("drafter", ["model", "ngram"])
# every draft length at the middle split in plain `pytest`; the first and last layers' splits (at k = 4) with the
# slow tests (scripts/test.sh, CI): a split changes which process runs a layer, not how a round's length is handled
@pytest.mark.parametrize(
    ("split", "k"),
    [(2, 1), (2, 4), (2, 8), pytest.param(1, 4, marks=pytest.mark.slow), pytest.param(3, 4, marks=pytest.mark.slow)],
)
def test_greedy_parity(family, split, drafter, k, models, hf_models, tokenizers, tails, redis_client):
    ms = models[family]
    names = tails.get(ms.target, split, ms.n_layers)
    runtime = head_for(ms, split, ms.drafter if drafter == "model" else None)
    expected = reference(family, hf_models[family], tokenizers[family])

    def one(prompt: str):
        req = GenerationRequest(
            prompt=prompt,
            max_new_tokens=NEW,
            chat_template=False,
            draft=DraftSettings(kind=drafter, k=k, adaptive=False),
        )
        return generate(req, runtime, redis_client, names=names)

    # four in flight, as traffic comes (one at a time, 20 cases took 2 minutes of the suite; a lone generation's
    # rounds are what test_greedy_parity_with_static_caches runs)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, PROMPTS))
    for prompt, want, got in zip(PROMPTS, expected, results, strict=True):
        assert got.token_ids == want, f"prompt {prompt!r}"
        assert got.finish_reason == ("eos" if want[-1] == 0 and len(want) < NEW else "length")
    if drafter == "model":
        assert sum(g.accepted_tokens for g in results) > 0  # the rejection and acceptance paths both ran


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_greedy_parity_with_static_caches(family, models, hf_models, tokenizers, tails, redis_client):
    """Static KV caches rolled back in place (the path CUDA graphs replay over) give the same tokens."""
    ms = models[family]
    names = tails.get(ms.target, 2, ms.n_layers, ("--static-cache",))
    runtime = HeadRuntime.load(ms.target, (0, 2), draft=ms.drafter, settings=Settings(engine={"static": True}))
    assert runtime.engine.pool is not None and type(runtime.engine.acquire()).__name__ == "StaticKVCache"
    expected = reference(family, hf_models[family], tokenizers[family])
    for k in (1, 8):
        for prompt, want in zip(PROMPTS, expected, strict=True):
            req = GenerationRequest(prompt=prompt, max_new_tokens=NEW, chat_template=False, draft=DraftSettings(k=k))
            assert generate(req, runtime, redis_client, names=names).token_ids == want, prompt


@pytest.mark.parametrize(
    ("family", "attention"),
    [("qwen2", "auto"), ("qwen2", "in_place"), pytest.param("llama", "auto", marks=pytest.mark.slow)],
)
def test_greedy_parity_batched_in_flight(
    family, attention, models, hf_models, tokenizers, tails, redis_client, monkeypatch
):
    """Generations in flight on one runtime run batched (drafts, head and tail forwards over several
    sequences' slots at once, plus one-slot pools beyond the slots) and still equal HF generate; also with the
    head's and drafter's attention over their pools in place (workers/engine/pool_attention.py's reference)."""
    from workers.engine import pool_attention

    monkeypatch.setattr(pool_attention, "SPLIT_MIN_BATCH", 2)  # batched rounds attend in two parts, merged
    ms = models[family]
    names = tails.get(ms.target, 2, ms.n_layers, ("--static-cache", "--slots", "3"))
    engine = {"static": True, "slots": 3, "attention": attention}
    runtime = HeadRuntime.load(ms.target, (0, 2), draft=ms.drafter, settings=Settings(engine=engine))
    assert runtime.engine.shard.attends_in_place == (attention == "in_place")
    expected = reference(family, hf_models[family], tokenizers[family])

    def one(i: int) -> list[int]:
        k = (1, 4, 8)[i % 3]
        kind = "ngram" if i % 5 == 4 else "model"
        req = GenerationRequest(
            prompt=PROMPTS[i], max_new_tokens=NEW, chat_template=False, draft=DraftSettings(kind=kind, k=k)
        )
        return generate(req, runtime, redis_client, names=names).token_ids

    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(one, range(len(PROMPTS))))
    assert got == expected
    assert runtime.batcher.batches < runtime.batcher.rounds  # rounds of several generations shared forwards
