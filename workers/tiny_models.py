"""Tiny random models and a tiny tokenizer, built and saved to disk for tests and CPU benches.

The models are real transformers checkpoints (config + safetensors + tokenizer), so every test runs
the real loading path. Inits are large enough that greedy output varies instead of repeating a token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Redis streams carry activations between two machines far apart.",
    "Speculative decoding drafts tokens cheaply and verifies them in one pass.",
    "A head worker runs the lower layers; a tail worker runs the upper layers.",
    "Once upon a time there was a small model that wanted to be large.",
    "Numbers like 1, 2, 3, 42 and 1000 appear in many sentences too.",
    "Hello world! How are you today? I am fine, thank you very much.",
    "def main():\n    print('hello')\n    return 0\n",
    "The capital of France is Paris, and the capital of Japan is Tokyo.",
    "Water boils at one hundred degrees Celsius at sea level.",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Varied prompts for checking tiny split models against HF generate (tests, bench/gpu_parity.py).
PROMPTS = [
    "Hello world! How are you today?",
    "The quick brown fox",
    "Once upon a time there was",
    "Numbers like 1, 2, 3, 42 and",
    "def main():\n    print(",
    "The capital of France is",
    "Water boils at",
    "Redis streams carry activations",
    "A head worker runs the lower layers;",
    "Speculative decoding drafts tokens cheaply and",
    "I am fine, thank you very much. I am fine, thank you",
    "the the the the the",
    "1, 2, 3, 1, 2, 3, 1, 2,",
    "Tokyo",
    "x",
    "Hello Hello Hello world world",
    "The lazy dog near the river bank jumps over the quick brown fox near the",
    "return 0\n",
    "Paris, and the capital of Japan",
    "one hundred degrees Celsius at sea level.",
]


def build_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on a built-in corpus (takes milliseconds)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIALS[0], pad_token=SPECIALS[0])
    fast.chat_template = CHAT_TEMPLATE
    return fast


OTHER_FAMILIES = ("gemma2", "gemma3_text", "olmo3", "cohere2")  # tests build these with a sliding window
# dense families run by their HF layers (tests/test_families.py), each its own config class
DENSE_FAMILIES = (
    "ministral3", "ministral", "phi3", "olmo2", "granite", "smollm3", "gemma", "exaone4", "glm4", "glm",
    "hunyuan_v1_dense", "seed_oss", "apertus", "arcee", "ernie4_5", "starcoder2", "stablelm", "nemotron", "cohere",
    "helium",
)  # fmt: skip
_ROUTED = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}
_GROUPED = _ROUTED | {"n_routed_experts": 8, "n_shared_experts": 1, "first_k_dense_replace": 1}
_GROUPED |= {"n_group": 2, "topk_group": 1}  # grouped top-k routing
# mixtures of experts, each its own config class: 8 small experts, 2 a token; shared experts and a first dense layer
# where the family has them; DeepSeek-V3's latent attention at small ranks (its rotary spans qk_rope_head_dim)
MOE_FAMILIES: dict[str, dict[str, object]] = {
    "qwen2_moe": _ROUTED | {"num_experts": 8, "shared_expert_intermediate_size": 64},
    "qwen3_moe": _ROUTED | {"num_experts": 12},  # past 10: experts stack in numeric order, not by name
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2},
    "olmoe": {"num_experts": 8, "num_experts_per_tok": 2},
    "glm4_moe": _GROUPED,
    "deepseek_v3": _GROUPED
    | {"kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16}
    | {"num_key_value_heads": 4},  # latent attention: a key per query head
    "gpt_oss": {"num_local_experts": 8, "num_experts_per_tok": 2},  # attention sinks, windows on every other layer
}


_LINEAR = {"linear_num_key_heads": 2, "linear_num_value_heads": 4}
_LINEAR |= {"linear_key_head_dim": 16, "linear_value_head_dim": 16}
# linear attention (Gated DeltaNet) beside full attention, 3 : 1 (their default layer types); MoE in two of them
HYBRID_FAMILIES: dict[str, dict[str, object]] = {
    "qwen3_next": _LINEAR | _ROUTED | {"num_experts": 8, "shared_expert_intermediate_size": 64},
    "qwen3_5_text": _LINEAR,
    "qwen3_5_moe_text": _LINEAR | _ROUTED | {"num_experts": 8, "shared_expert_intermediate_size": 64},
}


_S, _F = "sliding_attention", "full_attention"
# Gemma 4's text layers (workers/engine/per_layer.py): per-layer inputs, the last 2 layers reading the keys and values
# of layers 3 (sliding) and 2 (full), wider heads and one key/value head on full attention with keys as values,
# double-wide MLPs on the shared layers, a window shorter than the tests' prompts, the final logit soft cap
GEMMA4: dict[str, object] = {
    "layers": 6,
    "layer_types": [_S, _S, _F, _S, _S, _F],
    "global_head_dim": 32,
    "num_global_key_value_heads": 1,
    "attention_k_eq_v": True,
    "sliding_window": 8,
    "hidden_size_per_layer_input": 8,
    "num_kv_shared_layers": 2,
    "use_double_wide_mlp": True,
    "final_logit_softcapping": 30.0,
}


def tiny_config(
    family: str, vocab_size: int, *, layers: int = 4, hidden: int = 64, init: float = 0.25, **extra: object
):
    """A Qwen2-, Qwen3- or Mistral-shaped (untied head), Llama-shaped (tied embeddings), OTHER_FAMILIES or
    MOE_FAMILIES tiny config;
    `extra` sets more of the config's own fields (a sliding window, say), or overrides these (widths, heads)."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        initializer_range=init,
        eos_token_id=0,
        bos_token_id=0,
        pad_token_id=0,
    )
    if family == "qwen2":
        return Qwen2Config(**common | {"tie_word_embeddings": False, "use_sliding_window": False} | extra)
    if family == "llama":
        return LlamaConfig(**common | {"tie_word_embeddings": True} | extra)
    if family == "qwen3":  # per-head q/k norms
        return Qwen3Config(**common | {"tie_word_embeddings": False, "use_sliding_window": False} | extra)
    if family == "mistral":
        return MistralConfig(**common | {"tie_word_embeddings": False, "sliding_window": None} | extra)
    if (
        family in OTHER_FAMILIES or family in DENSE_FAMILIES
    ):  # their own config class, at these sizes (head_dim: their defaults are wide)
        return AutoConfig.for_model(family, **common, **{"head_dim": hidden // 4} | extra)
    if family == "gemma4_text":  # `GEMMA4` passed as `extra` (its layer types fit its layer count)
        return AutoConfig.for_model(
            family, **common | {"head_dim": hidden // 4, "vocab_size_per_layer_input": vocab_size} | extra
        )
    if family in HYBRID_FAMILIES:
        return AutoConfig.for_model(family, **common | {"head_dim": hidden // 4} | HYBRID_FAMILIES[family] | extra)
    if family in MOE_FAMILIES:
        head_dim = MOE_FAMILIES[family].get("qk_rope_head_dim", hidden // 4)
        return AutoConfig.for_model(family, **common | {"head_dim": head_dim} | MOE_FAMILIES[family] | extra)
    raise ValueError(f"unknown family {family!r}")


def save_tiny_model(
    out: str | Path,
    family: str = "qwen2",
    *,
    vocab_size: int | None = None,
    seed: int = 0,
    max_shard_size: str | None = None,
    tokenizer: PreTrainedTokenizerFast | None = None,
    **config_kw: object,
) -> Path:
    """Build a random model of `family`, save it (+ tokenizer) as a real checkpoint; return its dir."""
    out = Path(out)
    tok = tokenizer or build_tokenizer()
    config = tiny_config(family, vocab_size or len(tok), **config_kw)  # type: ignore[arg-type]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kw)
    tok.save_pretrained(out)
    return out


# multimodal wrappers: (their text family, a tiny vision tower of their own kind)
_VISION = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_hidden_layers": 1}
WRAPPERS: dict[str, tuple[str, dict[str, object]]] = {
    "gemma3": ("gemma3_text", _VISION | {"model_type": "siglip_vision_model", "patch_size": 14}),
    "qwen3_5": (
        "qwen3_5_text",
        {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64},
    ),
    "mistral3": ("ministral3", _VISION | {"model_type": "pixtral", "head_dim": 16}),
}


# wrappers whose text model is tested apart (tests/test_gemma4.py), with the text config's own fields
MORE_WRAPPERS: dict[str, tuple[str, dict[str, object]]] = {
    "gemma4": ("gemma4_text", _VISION | {"head_dim": 16, "num_key_value_heads": 2}),
}
TEXT_FIELDS: dict[str, dict[str, object]] = {"gemma4": GEMMA4}


def save_tiny_wrapper(out: str | Path, wrapper: str, *, tokenizer: PreTrainedTokenizerFast, seed: int = 0) -> Path:
    """A random multimodal model (`WRAPPERS`, `MORE_WRAPPERS`: a text model beside a vision tower) saved as the
    wrapper saves itself."""
    out, (family, vision) = Path(out), (WRAPPERS | MORE_WRAPPERS)[wrapper]
    text = tiny_config(family, len(tokenizer), **TEXT_FIELDS.get(wrapper, {}))  # type: ignore[arg-type]
    config = AutoConfig.for_model(wrapper, text_config=text.to_dict(), vision_config=vision)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = text.eos_token_id
    model.generation_config.pad_token_id = text.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def save_noisy_copy(src: str | Path, out: str | Path, noise: float, seed: int = 1) -> Path:
    """Save a copy of a model with Gaussian noise added to its weights: a drafter that agrees often."""
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * noise * p.std().clamp_min(1e-3))
    model.save_pretrained(out)
    PreTrainedTokenizerFast.from_pretrained(src).save_pretrained(out)
    return Path(out)


def save_scaled_copy(src: str | Path, out: str | Path, layer: int, factor: float) -> Path:
    """Save a copy of a model whose layer `layer` writes `factor` times larger values into the residual stream
    (its MLP's down projection scaled): 1e6 overflows float16; a few hundred stays in range with squares past it."""
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        model.model.layers[layer].mlp.down_proj.weight.mul_(factor)
    model.save_pretrained(out)
    PreTrainedTokenizerFast.from_pretrained(src).save_pretrained(out)
    return Path(out)


TIE_ULPS = 8  # where a half-precision generation parts from generate's: a tie if its logits are this close


def greedy_with_logits(hf: torch.nn.Module, ids: torch.Tensor, new: int) -> tuple[list[int], tuple[torch.Tensor, ...]]:
    """HF `generate(do_sample=False)` over one prompt's ids [1, T]: the new tokens and each step's raw logits (what
    `divergence_ulps` reads)."""
    out = hf.generate(  # type: ignore[operator]
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=new,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences[0, ids.shape[1] :].tolist(), out.logits


def divergence_ulps(
    got: Sequence[int], want: Sequence[int], logits: Sequence[torch.Tensor], dtype: torch.dtype
) -> float | None:
    """How far a generation that parts from HF generate's `want` parted: at the first differing step, how many
    units in the last place of `dtype` (at generate's best logit) apart generate's own logits put the token
    taken and generate's choice (`logits`: its per-step raw logits); None when they do not part, inf when one
    only ends sooner. In half precision a round's K+1-row forwards round differently from generate's one-row
    steps, so a few units (a tie at the dtype's rounding) can part them; more is a numerical error. (Near a
    zero logit the unit is tiny: a real tie there counts as far apart, on the safe side.)"""
    i = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
    if i is None:
        return None if len(got) == len(want) else math.inf
    row = logits[i].reshape(-1).float()
    best = float(row[want[i]])
    ulp = torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(max(abs(best), torch.finfo(dtype).tiny)))
    return abs(best - float(row[got[i]])) / ulp
