"""Linear attention beside full attention (Qwen3-Next, Qwen3.5, Qwen3.5-MoE: Gated DeltaNet layers with a convolution
state and a recurrent state): a shard's dynamic caches roll a rejected draft back by restoring the states at their base
and feeding the kept tokens again (workers/engine/recurrent.py), its static ones (the default) keep the states in
their pool (workers/engine/linear_pool.py, tests/test_linear_pool.py); either way a split generation equals HF
`generate`. Head and tail in separate processes over real Redis."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from schemas.requests import DraftSettings, GenerationRequest, SamplingParams
from schemas.settings import Settings
from tests.conftest import PROMPTS
from tests.test_sampling import DRAWS, VOCAB, chi2_pvalue, exact_distribution, sample_draws
from workers.engine.kvcache import StaticKVCache
from workers.engine.plan import GiB, kv_bytes, model_shape, plan_split
from workers.engine.recurrent import RecurrentCache
from workers.engine.runner import Engine
from workers.engine.shard import load_shard
from workers.head.runtime import HeadRuntime, generate
from workers.tiny_models import HYBRID_FAMILIES, save_noisy_copy, save_tiny_model

NEW = 16
QUICK = ("qwen3_5_text",)  # plain `pytest`; CI runs every family


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory, tokenizers):
    root, tok = tmp_path_factory.mktemp("hybrid"), tokenizers["qwen2"]
    return {f: save_tiny_model(root / f, f, tokenizer=tok) for f in HYBRID_FAMILIES}


def _hf(target):
    return AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()


def _families(quick: tuple[str, ...]) -> list:
    return [f if f in quick else pytest.param(f, marks=pytest.mark.slow) for f in HYBRID_FAMILIES]


@pytest.mark.parametrize("family", list(HYBRID_FAMILIES))
def test_split_shards_logits_equal_the_models(family, hybrid, tokenizers):
    """Split at every layer boundary (a head of linear layers only, a tail with both), a prompt then two rounds."""
    target, tok = hybrid[family], tokenizers["qwen2"]
    ids = torch.tensor(tok.encode(PROMPTS[0]))
    with torch.inference_mode():
        want = _hf(target)(ids[None]).logits[0]
        for split in (1, 2, 3):
            head = load_shard(target, (0, split), embed=True, head=False)
            tail = load_shard(target, (split, 4), embed=False, head=True)
            caches, parts, at = (head.new_cache(), tail.new_cache()), [], 0
            assert all(isinstance(c, RecurrentCache) for c in caches) or split == 3
            for n in (ids.shape[0] - 9, 5, 4):
                h = head.forward(ids[at : at + n], at, caches[0])
                parts.append(tail.forward(h, at, caches[1], logits_last=n))
                at += n
            torch.testing.assert_close(torch.cat(parts), want, rtol=1e-3, atol=1e-3, msg=f"{family} split {split}")


def _states(cache: RecurrentCache) -> list[torch.Tensor]:
    out = [
        t for layer in cache.layers.values() for t in (*layer.conv_states.values(), *layer.recurrent_states.values())
    ]
    return out + [cache.keys[i] for i in sorted(cache.keys)] + [cache.values[i] for i in sorted(cache.values)]


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_text"])
def test_a_rejected_draft_leaves_the_states_exactly_as_before(family, hybrid):
    """A round of 6 tokens of which 2 are kept: every conv state, recurrent state, key and value equals, bit for bit,
    those of a cache that was fed the prompt and then only the 2 kept tokens; rolling back everything leaves the
    prompt's states; and the next round continues from there."""
    shard = load_shard(hybrid[family], None, embed=True, head=True)
    prompt, kept, rejected = torch.arange(5, 25), torch.tensor([7, 8]), torch.tensor([9, 10, 11, 12])
    with torch.inference_mode():
        cache, clean = shard.new_cache(), shard.new_cache()
        for c in (cache, clean):
            shard.forward(prompt, 0, c)
            c.crop(20)  # commit the prompt
        before = [t.clone() for t in _states(cache)]
        shard.forward(torch.cat([kept, rejected]), 20, cache, logits_last=6)
        cache.crop(20)  # nothing kept
        assert all(torch.equal(a, b) for a, b in zip(_states(cache), before, strict=True))
        shard.forward(torch.cat([kept, rejected]), 20, cache, logits_last=6)
        cache.crop(22)
        shard.forward(kept, 20, clean)
        clean.crop(22)
        assert cache.length == clean.length == 22
        assert all(torch.equal(a, b) for a, b in zip(_states(cache), _states(clean), strict=True))
        nxt = torch.tensor([3, 4, 5])
        torch.testing.assert_close(
            shard.forward(nxt, 22, cache, logits_last=3), shard.forward(nxt, 22, clean, logits_last=3)
        )
        cache.crop(25)  # committed at 25: a later rollback cannot reach before it
        shard.forward(nxt, 25, cache)
        with pytest.raises(ValueError, match="rolls back to its base"):
            cache.crop(24)


def test_recurrent_shards_run_static_caches_by_default(hybrid):
    """Their states live in the pool (workers/engine/linear_pool.py); `--dynamic-cache` keeps the replaying cache."""
    shard = load_shard(hybrid["qwen3_5_text"], (0, 2), embed=True, head=False)
    assert isinstance(Engine(shard).acquire(), StaticKVCache)
    assert isinstance(Engine(shard, Settings(engine={"static": False})).acquire(), RecurrentCache)


def test_the_plan_counts_states_beside_the_attention_layers_keys(hybrid, tokenizers):
    """`shardflow plan` and the workers' preflight: keys/values only where a layer attends, each linear layer's
    states as big as a bfloat16 shard's cache holds them after a prompt (the recurrent state in float32)."""
    target = hybrid["qwen3_5_text"]
    config = AutoConfig.from_pretrained(target)
    shape = model_shape(config, torch.bfloat16)
    shard = load_shard(target, (0, 4), embed=True, head=True, dtype=torch.bfloat16)
    cache = shard.new_cache()
    with torch.inference_mode():
        shard.forward(torch.tensor(tokenizers["qwen2"].encode(PROMPTS[0])), 0, cache, logits_last=1)
    held = {
        i: sum(t.numel() * t.element_size() for t in [*layer.conv_states.values(), *layer.recurrent_states.values()])
        for i, layer in cache.layers.items()
    }
    assert shape.state_layer == tuple(held.get(i, 0) for i in range(4)) and shape.kv_layer[:3] == (0, 0, 0)
    ring = 2 * sum(shape.state_row[:3])  # and a static pool's inputs of its last positions (scratch 0: 2 columns)
    assert kv_bytes(shape, (0, 3), 1000, 0) == sum(held.values()) + ring  # linear layers: no keys however long
    assert shape.state_row[3] == 0 and ring > 0
    cfg = Settings(engine={"cuda_context_gib": 0})
    assert plan_split(config, [GiB, GiB], dtype=torch.bfloat16, settings=cfg).in_flight > 0


@pytest.mark.parametrize("family", _families(QUICK))
def test_hybrid_models_split_equal_generate(family, hybrid, tokenizers, tails, redis_client):
    """Greedy with model drafts (the model itself drafting: its own states rolled back) and n-gram drafts."""
    target, tok = hybrid[family], tokenizers["qwen2"]
    hf, names = _hf(target), tails.get(target, 2, 4)
    runtime = HeadRuntime.load(target, (0, 2), draft=str(target))
    for prompt in PROMPTS[:3]:
        ids = torch.tensor([tok.encode(prompt)])
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW)
        for kind, k in (("model", 4), ("ngram", 3)):
            req = GenerationRequest(
                prompt=prompt, max_new_tokens=NEW, chat_template=False, draft=DraftSettings(kind=kind, k=k)
            )
            got = generate(req, runtime, redis_client, names=names).token_ids
            assert got == want[0, ids.shape[1] :].tolist(), (family, prompt, kind)


@pytest.mark.slow
def test_hybrid_generations_in_flight_equal_generate(hybrid, tokenizers, tails, redis_client):
    """Several generations at once on one runtime and one tail: each sequence's states are its own."""
    target, tok = hybrid["qwen3_next"], tokenizers["qwen2"]
    hf, names = _hf(target), tails.get(target, 2, 4)
    runtime = HeadRuntime.load(target, (0, 2), draft=str(target))
    prompts = PROMPTS[:6]
    expected = []
    for p in prompts:
        ids = torch.tensor([tok.encode(p)])
        got = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW)
        expected.append(got[0, ids.shape[1] :].tolist())

    def one(p: str) -> list[int]:
        req = GenerationRequest(prompt=p, max_new_tokens=NEW, chat_template=False, draft=DraftSettings(k=4))
        return generate(req, runtime, redis_client, names=names).token_ids

    with ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(one, prompts)) == expected


@pytest.mark.slow
def test_hybrid_sampling_matches_the_targets_distribution(tmp_path, tails, redis_client):
    """Speculative rejection sampling on a three-layer Qwen3.5 split 1/3 (a linear layer on the head, a linear and the
    full-attention layer on the tail: states roll back on both sides), drafted by a noisy copy."""
    types = ["linear_attention", "linear_attention", "full_attention"]
    target = save_tiny_model(
        tmp_path / "t", "qwen3_5_text", vocab_size=VOCAB, layers=3, hidden=32, init=0.15, seed=3, layer_types=types
    )
    drafter = save_noisy_copy(target, tmp_path / "d", 0.6)
    names = tails.get(target, 1, 3)
    runtime = HeadRuntime.load(target, (0, 1), draft=drafter)
    runtime.eos_token_ids = []
    s = SamplingParams(temperature=1.0)
    counts, accepted, drafted = sample_draws(runtime, redis_client, names, s)
    assert 0 < accepted < drafted
    assert chi2_pvalue(counts, exact_distribution(target, s), DRAWS) > 1e-3
