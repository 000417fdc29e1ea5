"""Quantized experts (workers/engine/quant_experts.py): a mixture's 3-D expert weights stored int8 or NF4 and
dequantized at each forward compute exactly what transformers' own experts compute on the dequantized weights (bit for
bit), in about a half (int8) or a quarter (4-bit) of their 16-bit bytes; a split quantized MoE model equals HF
`generate` on the same model quantized by transformers' bitsandbytes integration with its experts fake-quantized
(replaced by their dequantized values: transformers leaves fused experts full width); the plan counts experts at their
quantized size and one layer's dequantized experts in a worker's workspace."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoConfig, AutoModelForCausalLM

from producer.cli import main
from schemas.settings import Settings
from tests.conftest import PROMPTS
from tests.test_quant import hf_quantized, references, run_split
from workers.engine.plan import model_shape, shard_weights
from workers.engine.quant_experts import (
    EXPERT_COPIES,
    dequantized_bytes,
    expert_weights,
    fake_quantize,
    quantize_experts,
    quantized_experts,
)
from workers.engine.shard import load_shard
from workers.engine.sizing import shard_workspace, workspace_bytes
from workers.head.runtime import HeadRuntime
from workers.tiny_models import save_tiny_model, tiny_config

FAMILIES = ("qwen3_moe", "gpt_oss")  # [E, 2I, H] gate and up concatenated; [E, H, 2I] transposed, interleaved, biases
EXTRA = {"gpt_oss": {"sliding_window": 8}}


@pytest.fixture(scope="module")
def moe(tmp_path_factory, tokenizers):
    root, tok = tmp_path_factory.mktemp("moe-quant"), tokenizers["qwen2"]
    return {f: save_tiny_model(root / f, f, tokenizer=tok, **EXTRA.get(f, {})) for f in FAMILIES}


def _experts(family: str, dtype: torch.dtype) -> tuple[torch.nn.Module, object]:
    config = tiny_config(family, 320)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.model.layers[0].mlp.experts.eval(), config


@pytest.mark.parametrize("family", [*FAMILIES, "mixtral"])
@pytest.mark.parametrize("scheme", ["int8", "4bit"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantized_experts_compute_the_dequantized_experts_bit_for_bit(family, scheme, dtype):
    experts, config = _experts(family, dtype)
    full = sum(experts._parameters[n].numel() for _, n in expert_weights(experts))
    reference = fake_quantize(copy.deepcopy(experts), scheme)
    quantize_experts(experts, scheme)
    assert quantized_experts(experts) == [experts] and not expert_weights(experts)  # no 3-D parameter left
    assert type(experts).__name__.startswith("Quantized") and isinstance(experts, type(reference))
    for _, name in expert_weights(reference):
        assert torch.equal(getattr(experts, name), getattr(reference, name)), name
        assert getattr(experts, name).dtype == dtype
    n, k = 13, config.num_experts_per_tok
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, config.hidden_size, generator=gen).to(dtype)
    idx = torch.stack([torch.randperm(experts.num_experts, generator=gen)[:k] for _ in range(n)])
    w = torch.softmax(torch.randn(n, k, generator=gen), -1).to(dtype)
    with torch.inference_mode():
        got, want = experts(x, idx, w), reference(x, idx, w)
    assert torch.equal(got, want)
    stored = sum(b.numel() * b.element_size() for b in experts.buffers())
    stored -= sum(b.numel() * b.element_size() for b in reference.buffers())
    ratio = stored / (2 * full)  # of the experts' bytes at 16 bits (a scale a row of 32 or more: 1/16 at most more)
    assert (0.5 <= ratio <= 0.5625) if scheme == "int8" else (0.25 <= ratio <= 0.29), ratio
    assert dequantized_bytes(experts) == EXPERT_COPIES * full * dtype.itemsize  # in the graphs' pool and out of it
    plain = _experts(family, dtype)[0]  # quantizing changed the weights, so the outputs
    assert not torch.equal(plain(x, idx, w), got)


def _reference(target, scheme: str, tok, prompts: list[str]) -> list[list[int]]:
    """HF `generate` on the model transformers quantizes (its linears, as the shards' are) with its experts
    fake-quantized as the shards store them."""
    return references(fake_quantize(hf_quantized(target, scheme), scheme), tok, prompts)


@pytest.mark.parametrize(
    ("family", "scheme"),
    [
        ("qwen3_moe", "4bit"),
        pytest.param("qwen3_moe", "int8", marks=pytest.mark.slow),
        pytest.param("gpt_oss", "4bit", marks=pytest.mark.slow),
        pytest.param("gpt_oss", "int8", marks=pytest.mark.slow),
    ],
)
def test_quantized_moe_split_equals_generate_on_the_fake_quantized_model(
    family, scheme, moe, tokenizers, tails, redis_client
):
    """A real tail process with --quant, the head's layers and its drafter (the model itself) quantized alike."""
    target, tok = moe[family], tokenizers["qwen2"]
    prompts = PROMPTS[:4]
    want = _reference(target, scheme, tok, prompts)
    assert want != references(hf_quantized(target, scheme), tok, prompts)  # the experts' quantization shows
    names = tails.get(target, 2, 4, ("--quant", scheme))
    settings = Settings(engine={"quant": scheme, "draft_quant": scheme})
    runtime = HeadRuntime.load(target, (0, 2), draft=str(target), settings=settings)
    assert all(quantized_experts(layer) for layer in runtime.shard.layers)
    assert quantized_experts(runtime.draft_model.engine.shard)
    assert run_split(runtime, names, redis_client, prompts) == want


@pytest.mark.parametrize("family", FAMILIES)
def test_the_plan_counts_experts_at_their_quantized_size(family, moe):
    """`model_shape` (from the config alone) equals what the loader holds at each scheme, experts quantized; one
    layer's dequantized experts join a worker's workspace, in the plan as in a loaded worker's sizing."""
    config = AutoConfig.from_pretrained(moe[family])
    settings = Settings()
    full = model_shape(config, torch.float32)
    for scheme, share in (("int8", 0.3), ("4bit", 0.2)):  # of float32 bytes
        shape = model_shape(config, torch.float32, scheme)
        for layers, embed, head in (((0, 2), True, False), ((2, 4), False, True)):
            shard = load_shard(moe[family], layers, embed=embed, head=head, quant=scheme)
            held, planned = shard.weight_bytes(), shard_weights(shape, layers, embed=embed, head=head)
            assert abs(planned - held) <= 0.02 * held, (family, scheme, layers, planned, held)
            scratch = max(dequantized_bytes(layer) for layer in shard.layers)
            assert scratch == shape.experts_scratch > 0
            assert shard_workspace(shard, settings) == workspace_bytes(config, 4, settings) + scratch
        experts = sum(getattr(m, n).numel() * 4 for m, n in expert_weights(shard.layers[0]))
        assert full.layer[0] - shape.layer[0] > (1 - share) * experts  # the experts shrank, not only the linears
    assert full.experts_scratch == 0


def test_plan_command_counts_quantized_experts(moe):
    """`shardflow plan --json`: the same weights as `model_shape`, and the workspace with one layer's experts."""
    target = moe["qwen3_moe"]
    config = AutoConfig.from_pretrained(target)
    runner = CliRunner()
    plans = {}
    for scheme in ("none", "4bit"):
        res = runner.invoke(main, ["plan", "--target", str(target), "--gpus", "4GiB,4GiB", "--quant", scheme, "--json"])
        assert res.exit_code == 0, res.output
        plans[scheme] = json.loads(res.output)
    shape, split = model_shape(config, torch.float32, "4bit"), plans["4bit"]["workers"][0]["layers"][1]
    head, tail = plans["4bit"]["workers"]
    assert head["weights"] == shard_weights(shape, (0, split), embed=True, head=False)
    assert tail["weights"] == shard_weights(shape, (split, 4), embed=False, head=True)
    assert tail["weights"] < plans["none"]["workers"][1]["weights"] / 4
    assert tail["workspace"] == plans["none"]["workers"][1]["workspace"] + shape.experts_scratch
