"""Mixtures of experts (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE, GLM-4 MoE, DeepSeek-V3, gpt-oss): checkpoints that store
each expert's projections one by one load into transformers' fused expert modules through the family's own conversion
mapping (workers/engine/convert.py), shared experts and first dense layers included, DeepSeek-V3's latent attention
and gpt-oss's attention sinks and windows too. Split generations equal HF `generate` on the same checkpoint; head and
tail in separate processes over real Redis."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from schemas.requests import DraftSettings, GenerationRequest, SamplingParams
from schemas.settings import Settings
from tests.conftest import PROMPTS
from tests.test_sampling import DRAWS, VOCAB, chi2_pvalue, exact_distribution, sample_draws
from workers.engine.kvcache import KVCache, KVPool
from workers.engine.plan import model_shape, shard_weights
from workers.engine.shard import load_shard
from workers.head.runtime import HeadRuntime, generate
from workers.tiny_models import MOE_FAMILIES, save_noisy_copy, save_tiny_model

NEW = 16
EXTRA = {"gpt_oss": {"sliding_window": 8}}  # its windows cut inside the prompts
QUICK = ("qwen3_moe", "deepseek_v3", "gpt_oss")  # plain `pytest`; CI runs every family


@pytest.fixture(scope="module")
def moe(tmp_path_factory, tokenizers):
    root, tok = tmp_path_factory.mktemp("moe"), tokenizers["qwen2"]
    return {f: save_tiny_model(root / f, f, tokenizer=tok, **EXTRA.get(f, {})) for f in MOE_FAMILIES}


def _hf(target):
    return AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32, attn_implementation="eager").eval()


def _reference(target, prompts: list[str], tok) -> list[list[int]]:
    hf, out = _hf(target), []
    for p in prompts:
        ids = torch.tensor([tok.encode(p)])
        got = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW)
        out.append(got[0, ids.shape[1] :].tolist())
    return out


def _families(quick: tuple[str, ...]) -> list:
    return [f if f in quick else pytest.param(f, marks=pytest.mark.slow) for f in MOE_FAMILIES]


def test_checkpoints_store_experts_one_by_one(moe):
    """What the tests load is what the hub ships: per-expert tensors, no fused ones (gpt-oss stores them fused)."""
    for family, target in moe.items():
        with safe_open(str(target / "model.safetensors"), framework="pt") as f:
            names = list(f.keys())
        fused = any(n.endswith("experts.gate_up_proj") for n in names)
        assert fused == (family == "gpt_oss"), family
        if family != "gpt_oss":
            assert any(".experts.7." in n for n in names), family  # every expert stored alone


@pytest.mark.parametrize("family", _families(tuple(MOE_FAMILIES)))
def test_a_whole_shards_logits_equal_the_models(family, moe, tokenizers):
    """Every logit (sampling reads them all), the model whole and split at every layer boundary, prompt then rounds."""
    target, tok = moe[family], tokenizers["qwen2"]
    ids = torch.tensor(tok.encode(PROMPTS[0]))
    with torch.inference_mode():
        want = _hf(target)(ids[None]).logits[0]
        got = load_shard(target, None, embed=True, head=True).forward(ids, 0, KVCache(), logits_last=ids.shape[0])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for split in (1, 2, 3):
            head = load_shard(target, (0, split), embed=True, head=False)
            tail = load_shard(target, (split, 4), embed=False, head=True)
            caches, parts, at = (KVCache(), KVCache()), [], 0
            for n in (ids.shape[0] - 9, 5, 4):  # a prompt, then two rounds
                h = head.forward(ids[at : at + n], at, caches[0])
                parts.append(tail.forward(h, at, caches[1], logits_last=n))
                at += n
            torch.testing.assert_close(torch.cat(parts), want, rtol=1e-4, atol=1e-4, msg=f"{family} split {split}")


@pytest.mark.parametrize("family", _families(QUICK))
def test_moe_models_split_equal_generate(family, moe, tokenizers, tails, redis_client):
    """Greedy with model drafts (the model itself drafting) and n-gram drafts, a real tail process."""
    target, tok = moe[family], tokenizers["qwen2"]
    prompts = PROMPTS[:3]
    expected = _reference(target, prompts, tok)
    names = tails.get(target, 2, 4)
    runtime = HeadRuntime.load(target, (0, 2), draft=str(target))
    for prompt, want in zip(prompts, expected, strict=True):
        for kind, k in (("model", 4), ("ngram", 3)):
            req = GenerationRequest(
                prompt=prompt, max_new_tokens=NEW, chat_template=False, draft=DraftSettings(kind=kind, k=k)
            )
            assert generate(req, runtime, redis_client, names=names).token_ids == want, (family, prompt, kind)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_moe_generations_in_flight_equal_generate(family, moe, tokenizers, tails, redis_client):
    """Several generations at once on static caches: one batched forward over their slots routes every token of
    every sequence (shared experts too), each equal to its own `generate`."""
    target, tok = moe[family], tokenizers["qwen2"]
    prompts = PROMPTS[:6]
    expected = _reference(target, prompts, tok)
    names = tails.get(target, 2, 4, ("--static-cache",))
    runtime = HeadRuntime.load(target, (0, 2), draft=str(target), settings=Settings(engine={"static": True}))

    def one(p: str) -> list[int]:
        req = GenerationRequest(prompt=p, max_new_tokens=NEW, chat_template=False, draft=DraftSettings(k=4))
        return generate(req, runtime, redis_client, names=names).token_ids

    with ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(one, prompts)) == expected


@pytest.mark.slow
def test_moe_sampling_matches_the_targets_distribution(tmp_path, tails, redis_client):
    """Speculative rejection sampling on a Qwen3-MoE split 1/2, drafted by a noisy copy: the sequences drawn follow
    the target's exact distribution (χ²), with both acceptance and rejection seen."""
    target = save_tiny_model(tmp_path / "t", "qwen3_moe", vocab_size=VOCAB, layers=2, hidden=32, init=0.15, seed=3)
    drafter = save_noisy_copy(target, tmp_path / "d", 0.6)
    names = tails.get(target, 1, 2)
    runtime = HeadRuntime.load(target, (0, 1), draft=drafter)
    runtime.eos_token_ids = []
    s = SamplingParams(temperature=1.0)
    counts, accepted, drafted = sample_draws(runtime, redis_client, names, s)
    assert 0 < accepted < drafted
    assert chi2_pvalue(counts, exact_distribution(target, s), DRAWS) > 1e-3


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_the_plan_counts_every_expert_and_the_cache_a_layer_keeps(family, moe):
    """`shardflow plan`'s numbers from the config alone: every expert (shared ones too) and a first dense layer that
    weighs less than the rest, as the loader holds them; keys and values per position as the pool allocates them
    (DeepSeek-V3: one compressed latent and one rotary key a layer, not a key and value per head)."""
    config = AutoConfig.from_pretrained(moe[family])
    shape = model_shape(config, torch.float32)
    for layers, embed, head in (((0, 2), True, False), ((2, 4), False, True), ((0, 4), True, True)):
        held = load_shard(moe[family], layers, embed=embed, head=head).weight_bytes()
        planned = shard_weights(shape, layers, embed=embed, head=head)
        assert abs(planned - held) <= 0.01 * held, (family, layers, planned, held)  # held: the rotary's buffers too
    tail = load_shard(moe[family], (2, 4), embed=False, head=True)
    assert KVPool.slot_bytes(tail, 16 * 4, 0) == 2 * shape.kv_per_position * 16 * 4
    pool = KVPool.for_shard(tail, slots=2, max_len=64, scratch=0)
    per_position = sum(t[0, :, 0].numel() * 4 for t in (*pool.keys.values(), *pool.values.values()))
    assert per_position == 2 * shape.kv_per_position  # two layers
    if family == "deepseek_v3":
        assert shape.layer[0] < shape.layer[1]  # first_k_dense_replace = 1
        assert shape.kv_per_position == (config.kv_lora_rank + config.qk_rope_head_dim) * 4
