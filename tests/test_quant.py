"""Quantized shards (workers/engine/quant.py): a split int8 or 4-bit model equals HF `generate` on the same
model quantized by transformers' own bitsandbytes integration; checkpoints saved quantized load as stored;
quantizing happens layer by layer as the shard loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from schemas.errors import ModelLoadError
from schemas.requests import DraftSettings, GenerationRequest
from schemas.settings import Settings
from tests.conftest import PROMPTS
from workers.engine import shard as shard_mod
from workers.engine.quant import exact_on_cpu, is_quantized, transformers_config
from workers.engine.shard import load_shard
from workers.head.runtime import HeadRuntime, generate

NEW = 16


def hf_quantized(path: Path, scheme: str | None):
    """The unsplit model as transformers quantizes it (scheme None: as the checkpoint stores it)."""
    kw = {"quantization_config": transformers_config(scheme, torch.float32)} if scheme else {}
    model = AutoModelForCausalLM.from_pretrained(path, device_map="cpu", **kw).eval()
    for m in model.modules():
        exact_on_cpu(m)  # the same CPU kernel the workers use (the AVX512-BF16 one rounds by row count)
    return model


def references(hf, tok, prompts: list[str]) -> list[list[int]]:
    out = []
    for p in prompts:
        ids = torch.tensor([tok.encode(p)])
        gen = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW)
        out.append(gen[0, ids.shape[1] :].tolist())
    return out


def run_split(runtime: HeadRuntime, names, redis_client, prompts: list[str], k: int = 4) -> list[list[int]]:
    outs = []
    for p in prompts:
        req = GenerationRequest(prompt=p, max_new_tokens=NEW, chat_template=False, draft=DraftSettings(k=k))
        outs.append(generate(req, runtime, redis_client, names=names).token_ids)
    return outs


@pytest.mark.parametrize("scheme", ["4bit", pytest.param("int8", marks=pytest.mark.slow)])
def test_quantized_split_equals_hf_generate_on_the_quantized_model(
    scheme, models, tokenizers, hf_models, tails, redis_client
):
    ms, tok = models["qwen2"], tokenizers["qwen2"]
    prompts = PROMPTS[:8]
    want = references(hf_quantized(ms.target, scheme), tok, prompts)
    assert want != references(hf_models["qwen2"], tok, prompts)  # quantizing changed the model's output
    names = tails.get(ms.target, 2, ms.n_layers, ("--quant", scheme))
    runtime = HeadRuntime.load(
        ms.target, (0, 2), draft=ms.drafter, settings=Settings(engine={"quant": scheme, "draft_quant": scheme})
    )
    assert runtime.shard.quant == scheme and runtime.draft_model.engine.shard.quant == scheme
    assert all(is_quantized(m) for m in runtime.shard.layers[0].modules() if isinstance(m, nn.Linear))
    plain = load_shard(ms.target, (0, 2), embed=True, head=False)
    assert runtime.shard.weight_bytes() < plain.weight_bytes()
    assert run_split(runtime, names, redis_client, prompts) == want


def test_prequantized_checkpoint_loads_as_stored(models, tokenizers, tails, redis_client, tmp_path):
    """A checkpoint transformers saved 4-bit: head and tail load its codes as they are (no --quant needed), and
    the split output equals HF generate on that checkpoint."""
    ms, tok = models["qwen2"], tokenizers["qwen2"]
    saved = tmp_path / "nf4"
    hf_quantized(ms.target, "4bit").save_pretrained(saved)
    PreTrainedTokenizerFast.from_pretrained(ms.target).save_pretrained(saved)
    prompts = PROMPTS[8:14]
    want = references(hf_quantized(saved, None), tok, prompts)
    names = tails.get(saved, 2, ms.n_layers)
    runtime = HeadRuntime.load(saved, (0, 2))
    assert runtime.shard.quant == "4bit"
    assert run_split(runtime, names, redis_client, prompts) == want
    with pytest.raises(ModelLoadError, match="stored as 4bit"):
        load_shard(saved, (0, 2), embed=True, head=False, quant="int8")


def test_layers_quantize_as_they_load(models, monkeypatch):
    """Each layer is quantized right after it loads, before the next one loads: at most one layer is held at
    full width while a shard loads quantized."""
    events: list[str] = []
    real_quantize, real_materialise = shard_mod.quantize_layer, shard_mod.materialise

    def quantize(layer, scheme, dtype):
        full = sum(type(m) is nn.Linear and not m.weight.is_meta for m in layer.modules())
        events.append(f"quantize {layer.self_attn.layer_idx} ({full} full-width)")
        real_quantize(layer, scheme, dtype)
        assert not any(type(m) is nn.Linear for m in layer.modules())

    def materialise(module, prefix, *a, **kw):
        if prefix.startswith("model.layers."):
            events.append(f"load {prefix.split('.')[2]}")
        return real_materialise(module, prefix, *a, **kw)

    monkeypatch.setattr(shard_mod, "quantize_layer", quantize)
    monkeypatch.setattr(shard_mod, "materialise", materialise)
    shard = load_shard(models["qwen2"].target, None, embed=True, head=True, quant="4bit")
    assert events == [e for i in range(4) for e in (f"load {i}", f"quantize {i} (7 full-width)")]
    assert shard.quant == "4bit" and shard.dtype == torch.float32
