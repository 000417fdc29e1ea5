"""bench/stages_floor.py's floor shapes: one width for every layer where a config has one; where layers differ
(Gemma 4: wider full-attention heads, double-wide MLPs, KV-shared layers), each layer as loaded."""

from __future__ import annotations

import torch

from bench.stages_floor import Shape, uniform
from workers.tiny_models import GEMMA4, tiny_config


def test_a_shape_sums_each_layers_own_widths_where_they_differ():
    from transformers import AutoModelForCausalLM

    plain = Shape.of(tiny_config("qwen2", 128, layers=4), 4, True, torch.float32)
    h = 64
    assert plain.gemm_params == 4 * (h * 64 + 2 * h * 32 + 64 * h + 3 * h * 128) + 128 * h
    assert plain.kv_bytes(2, 100) == 2 * 4 * 2 * 32 * 100 * 4
    config = tiny_config("gemma4_text", 128, **GEMMA4)
    assert uniform(plain_config := tiny_config("qwen2", 128)) and plain_config and not uniform(config)
    layers = AutoModelForCausalLM.from_config(config).model.layers
    tail = Shape.of_layers(config, layers[2:], True, torch.bfloat16)
    linear = sum(m.weight.numel() for layer in layers[2:] for m in layer.modules() if isinstance(m, torch.nn.Linear))
    assert tail.gemm_params == linear + 128 * h  # each layer's own projections (double-wide MLPs), the LM head
    assert [kv for _, _, kv in tail.per_layer][-2:] == [0, 0]  # KV-shared layers cache nothing
    assert tail.flops(9, 100) == 2.0 * 9 * tail.gemm_params + 4 * 9 * 100 * sum(q for _, q, _ in tail.per_layer)
