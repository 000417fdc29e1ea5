"""Benchmark plugin (workers/plugins.py): synthetic acceptance and random-weight models of public shapes.

Random weights make drafts meaningless, so benchmarks set acceptance instead: the `synthetic` drafter runs
the head's real draft model (paying its cost), then proposes the target's own reference continuation with
each token replaced by a wrong one with probability 1 - alpha. `random:<preset>` targets (RANDOM_PRESETS)
build random weights of a public model's shape on the device; they take token ids only.

    shardflow tail --plugin bench.synthetic --target random:qwen2.5-7b --layers 14:28
    shardflow head --plugin bench.synthetic --target random:qwen2.5-7b --layers 0:14 --draft random:qwen2.5-0.5b
    request: {"prompt_ids": [...], "draft": {"kind": "synthetic", "k": 8,
              "options": {"alpha": 0.78, "reference_ids": [...]}}}

A production worker (no --plugin) refuses both with a clear error.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from transformers import AutoConfig

from schemas.errors import InvalidRequest, ModelLoadError
from schemas.requests import SamplingParams, TokenId
from workers.engine.shard import Source
from workers.plugins import DrafterContext, ModelSource, Registry, load_plugins
from workers.speculative.drafters import Draft, DraftSession, ModelDraftSession


def random_source(seed: int, std: float = 0.02) -> Source:
    """Random weights (benchmarks of model shapes whose weights cannot be fetched); norms and Gemma 4's layer
    scalars are ones (random scalars near 0 would wash the token out of every layer: near-tied greedy choices).

    The LM head copies the embedding and the residual branches' output projections are small, so the
    model's greedy choice has a wide margin (it mostly repeats a token): speculative and plain paths,
    whose bf16 kernels round differently, still agree, and synthetic acceptance means what it says."""

    def make(names: dict[str, str], shapes: dict[str, tuple], dtype: torch.dtype, device: str) -> dict:
        out = {}
        for local, ckpt in names.items():
            key = "model.embed_tokens.weight" if ckpt == "lm_head.weight" else ckpt
            gen = torch.Generator(device=device).manual_seed(seed + zlib.crc32(key.encode()))
            scale = 0.01 if ckpt.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")) else 1.0
            scale = 50.0 if key == "model.embed_tokens.weight" else scale  # token identity dominates the residual
            if "norm" in ckpt or ckpt.endswith("layer_scalar"):  # Gemma 4 scales each layer's output by its scalar
                out[local] = torch.ones(shapes[local], dtype=dtype, device=device)
            elif ckpt.endswith("bias"):
                out[local] = torch.zeros(shapes[local], dtype=dtype, device=device)
            else:
                t = torch.empty(shapes[local], dtype=dtype, device=device)
                out[local] = t.normal_(0.0, std * scale, generator=gen)
        return out

    return make


# Shapes of public models, for `random:<name>` targets in benchmarks (no weights are fetched).
RANDOM_PRESETS: dict[str, dict] = {
    "qwen2.5-7b": dict(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        rope_theta=1e6,
        eos_token_id=151645,
    ),
    "qwen2.5-14b": dict(
        vocab_size=152064,
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=48,
        num_attention_heads=40,
        num_key_value_heads=8,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        rope_theta=1e6,
        eos_token_id=151645,
    ),
    "qwen2.5-32b": dict(  # issue 59's 4-bit shape over four 15 GiB workers
        vocab_size=152064,
        hidden_size=5120,
        intermediate_size=27648,
        num_hidden_layers=64,
        num_attention_heads=40,
        num_key_value_heads=8,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        rope_theta=1e6,
        eos_token_id=151645,
    ),
    "qwen2.5-0.5b": dict(
        vocab_size=152064,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        rope_theta=1e6,
        eos_token_id=151645,
    ),
    # issue 28's families (config class by "family"; public configs' shapes)
    "qwen3-8b": dict(
        family="qwen3",
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        rope_theta=1e6,
        eos_token_id=151645,
    ),
    "qwen3-30b-a3b": dict(
        family="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        rope_theta=1e6,
        eos_token_id=151645,
    ),
    "gpt-oss-20b": dict(
        family="gpt_oss",
        vocab_size=201088,
        hidden_size=2880,
        intermediate_size=2880,
        num_local_experts=32,
        num_experts_per_tok=4,
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        sliding_window=128,
        max_position_embeddings=131072,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        },
        tie_word_embeddings=False,
        eos_token_id=200002,
    ),
    "gemma-3-12b": dict(
        family="gemma3_text",
        vocab_size=262208,
        hidden_size=3840,
        intermediate_size=15360,
        num_hidden_layers=48,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=1024,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        eos_token_id=106,
    ),
    # drafters for them: Qwen3-0.6B; Gemma 3 1B and a 0.5B-shaped one with the target's vocabulary (a drafter's
    # vocabulary may not be smaller than its target's; Gemma 3 1B's is 64 tokens short of 12B's padded one)
    "qwen3-0.6b": dict(
        family="qwen3",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        rope_theta=1e6,
        eos_token_id=151645,
    ),
    "gemma-3-1b": dict(
        family="gemma3_text",
        vocab_size=262208,
        hidden_size=1152,
        intermediate_size=6912,
        num_hidden_layers=26,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=512,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        eos_token_id=106,
    ),
    # transformers' own Gemma4TextConfig defaults, which its docstring calls similar to google/gemma-4-e2b-it: 30
    # layers (5 sliding of 512 : 1 full), per-layer inputs 256 wide, tied embeddings of 262,144 tokens; and, our
    # choice, the last 10 layers reading the keys of layers 17 (full) and 19 (sliding), as Gemma 4's KV sharing does
    "gemma-4-e2b": dict(
        family="gemma4_text",
        vocab_size=262144,
        num_hidden_layers=30,
        num_kv_shared_layers=10,
        eos_token_id=106,
    ),
    "hybrid-4b": dict(  # Qwen3.5's layout (Gated DeltaNet : full attention 3 : 1), dimensions of our choosing
        family="qwen3_5_text",
        vocab_size=151936,
        hidden_size=2560,
        intermediate_size=9216,
        num_hidden_layers=32,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        eos_token_id=151645,
    ),
    "o200k-0.5b": dict(
        vocab_size=201088,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        rope_theta=1e6,
        eos_token_id=200002,
    ),
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    ),
}


class SyntheticDrafter:
    """Proposes the target's own reference continuation, each token replaced by a wrong
    one with probability 1 - alpha, so acceptance is set while every round still runs the real path."""

    name = "synthetic"
    device = torch.device("cpu")
    proposes_alone = True  # `finish` ignores the inner draft: the head queues its lower shard without reading it

    def __init__(
        self, reference: list[int], alpha: float, prompt_len: int, vocab: int, inner: DraftSession | None = None
    ) -> None:
        self.reference, self.alpha, self.prompt_len, self.vocab = reference, alpha, prompt_len, vocab
        self.inner = inner  # a real drafter run only to pay its cost (its proposals are discarded)

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()

    @property
    def model_session(self) -> ModelDraftSession | None:
        return self.inner if isinstance(self.inner, ModelDraftSession) else None

    def propose(self, context: list[int], k: int, sampling: SamplingParams, gen: torch.Generator) -> Draft:
        draft = self.inner.propose(context, k, sampling, gen) if self.inner is not None else Draft([])
        return self.finish(draft, context, k, gen)

    def finish(self, draft: Draft, context: list[int], k: int, gen: torch.Generator | None) -> Draft:
        """The synthetic proposal itself (the inner drafter's `draft` only paid its cost)."""
        at = len(context) - self.prompt_len
        want = self.reference[at : at + k]
        keep = (torch.rand(len(want), generator=gen) < self.alpha).tolist()
        shift = torch.randint(1, self.vocab, (len(want),), generator=gen).tolist()
        return Draft(
            [t if ok else (t + s) % self.vocab for t, ok, s in zip(want, keep, shift, strict=True)], point=True
        )


class IdTokenizer:
    """Stands in for a tokenizer with random-weight targets: token ids only."""

    chat_template = None

    def encode(self, text: str) -> list[int]:
        raise InvalidRequest("this target has no tokenizer: send prompt_ids")

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(map(str, ids))


class SyntheticOptions(BaseModel):
    """`draft.options` of a synthetic request."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    alpha: float = Field(0.78, ge=0.0, le=1.0, description="Chance each draft token is right.")
    reference_ids: list[TokenId] = Field(max_length=1 << 16, description="The target's own continuation.")


def random_model(preset: str) -> ModelSource:
    """The `random:` scheme: a preset's config and seeded random weights."""
    shape = RANDOM_PRESETS.get(preset)
    if shape is None:
        raise ModelLoadError(f"unknown random preset {preset!r}; known: {sorted(RANDOM_PRESETS)}")
    eos, fields = shape.get("eos_token_id"), {k: v for k, v in shape.items() if k != "family"}
    config = AutoConfig.for_model(shape.get("family", "qwen2"), **fields)
    return ModelSource(config, random_source(seed=0), IdTokenizer(), () if eos is None else (eos,))


def synthetic_session(options: dict[str, Any], ctx: DrafterContext) -> DraftSession:
    try:
        opts = SyntheticOptions.model_validate(options)
    except ValidationError as e:
        raise InvalidRequest(f"synthetic drafter options: {e.errors()[0]['msg']}") from None
    return SyntheticDrafter(opts.reference_ids, opts.alpha, ctx.prompt_len, ctx.vocab_size, ctx.model_session)


def register(registry: Registry) -> None:
    """The plugin's entry point (workers/plugins.py)."""
    registry.add_drafter("synthetic", synthetic_session)
    registry.add_scheme("random", random_model)


def registry() -> Registry:
    """A registry holding this plugin, for benchmarks that load shards or runtimes in-process."""
    return load_plugins([__name__])


def preset_of(target: str) -> dict | None:
    """The preset shape behind a `random:<preset>` target (None for anything else)."""
    return RANDOM_PRESETS.get(target.split(":", 1)[1]) if target.startswith("random:") else None


def load_shard(target: str, layers: tuple[int, int] | None, **kwargs: Any):
    """workers.engine.shard.load_shard that also takes `random:<preset>` targets (benchmark scripts)."""
    return registry().load_shard(target, layers, **kwargs)
