"""Dense causal families run by their HF layers (workers/tiny_models.py DENSE_FAMILIES), each built from its own
transformers config class: a whole shard's every logit equals the model's, split shards equal it too, and a split
generation with a real tail process equals HF `generate`. The model-level scales their forwards apply outside the
layers (Granite's embedding and logit multipliers, Cohere's logit scale) are set away from 1 so they count; Llama runs
with YaRN rope scaling. Families with recurrent-state layers are refused at load, naming the layer. (Gemma 4, whose
layers take per-layer inputs and shared keys: tests/test_gemma4.py.)"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from schemas.errors import ModelLoadError
from schemas.requests import DraftSettings, GenerationRequest
from tests.conftest import PROMPTS
from workers.engine.kvcache import KVCache
from workers.engine.plan import model_shape
from workers.engine.shard import load_shard
from workers.head.runtime import HeadRuntime, generate
from workers.tiny_models import DENSE_FAMILIES, save_tiny_model

NEW = 16
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512, "rope_theta": 10000.0}
EXTRA: dict[str, dict[str, object]] = {
    "granite": {
        "embedding_multiplier": 3.0,
        "logits_scaling": 4.0,
        "residual_multiplier": 0.5,
        "attention_multiplier": 0.2,
    },
    "cohere": {"logit_scale": 0.5},
    "llama": {"rope_parameters": YARN},
}
FAMILIES = (*DENSE_FAMILIES, "llama")
QUICK = ("granite", "phi3", "cohere")  # generate through a tail process in plain `pytest`; CI runs every family


@pytest.fixture(scope="module")
def dense(tmp_path_factory, tokenizers):
    root, tok = tmp_path_factory.mktemp("dense"), tokenizers["qwen2"]
    return {f: save_tiny_model(root / f, f, tokenizer=tok, **EXTRA.get(f, {})) for f in FAMILIES}


def _hf(target):
    return AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_shards_logits_equal_the_models(family, dense, tokenizers):
    target, tok = dense[family], tokenizers["qwen2"]
    ids = torch.tensor(tok.encode(PROMPTS[1]))
    with torch.inference_mode():
        want = _hf(target)(ids[None]).logits[0]
        whole = load_shard(target, None, embed=True, head=True)
        torch.testing.assert_close(whole.forward(ids, 0, KVCache(), logits_last=len(ids)), want, rtol=1e-4, atol=1e-4)
        head, tail = (
            load_shard(target, (0, 1), embed=True, head=False),
            load_shard(target, (1, 4), embed=False, head=True),
        )
        got = tail.forward(head.forward(ids, 0, KVCache()), 0, KVCache(), logits_last=len(ids))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", [f if f in QUICK else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES])
def test_split_generation_equals_generate(family, dense, tokenizers, tails, redis_client):
    """Greedy, model drafts (the model itself) and n-gram drafts, split 2/4."""
    target, tok = dense[family], tokenizers["qwen2"]
    hf, names = _hf(target), tails.get(target, 2, 4)
    runtime = HeadRuntime.load(target, (0, 2), draft=str(target))
    for prompt in PROMPTS[:2]:
        ids = torch.tensor([tok.encode(prompt)])
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW)
        for kind, k in (("model", 4), ("ngram", 3)):
            req = GenerationRequest(
                prompt=prompt, max_new_tokens=NEW, chat_template=False, draft=DraftSettings(kind=kind, k=k)
            )
            got = generate(req, runtime, redis_client, names=names).token_ids
            assert got == want[0, ids.shape[1] :].tolist(), (family, prompt, kind)


@pytest.mark.parametrize("family", ["falcon_h1", "lfm2"])
def test_other_layouts_are_refused_at_load(family, tmp_path, tokenizers):
    """Mamba-style and convolution mixers beside attention (no rotary, no `self_attn`): one clear line at load."""
    config = AutoConfig.for_model(
        family,
        vocab_size=len(tokenizers["qwen2"]),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / family)
    with pytest.raises(ModelLoadError, match=r"not laid out like Qwen2/Llama|recurrent state"):
        load_shard(tmp_path / family, (0, 2), embed=True, head=True)
    with pytest.raises(ModelLoadError, match=r"not laid out like Qwen2/Llama|recurrent state"):  # `shardflow plan`
        model_shape(config, torch.float32)
