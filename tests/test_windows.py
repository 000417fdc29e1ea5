"""Sliding-window attention (Mistral's `sliding_window`, the sliding layers of Qwen2, Qwen3, Gemma 2 / 3, OLMo 3 and
Cohere 2): a window shorter than the context is applied through the masks a shard builds over every cache (dynamic,
static, batched), and a split generation equals HF `generate` on the same checkpoint. Windows of 8 positions, prompts
and generations longer than that, so the window cuts; head and tail in separate processes over real Redis."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, MistralConfig, Qwen2Config

from schemas.errors import ModelLoadError
from schemas.requests import DraftSettings, GenerationRequest
from schemas.settings import Settings
from tests.conftest import PROMPTS
from workers.engine.kvcache import KVCache, causal
from workers.engine.plan import model_shape
from workers.engine.shard import load_shard
from workers.engine.windows import layer_windows
from workers.head.runtime import HeadRuntime, generate
from workers.tiny_models import save_tiny_model

NEW = 24
WINDOW = 8
# (family, config fields): every layer windowed; the upper half only (the tail's, split at 2); the lower half only
WINDOWED = {
    "mistral": ("mistral", {"sliding_window": WINDOW}),
    "ministral": ("ministral", {"sliding_window": WINDOW}),  # its layer_types: every layer sliding
    "qwen2-upper": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 2}),
    "qwen3-upper": ("qwen3", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 2}),
    # families run by their HF layers: Gemma 2 (soft caps, 1 + w norms, a scaled embedding), Gemma 3 (a rotary per
    # layer type, 5 local : 1 global), OLMo 3, Cohere 2
    "gemma2": ("gemma2", {"sliding_window": WINDOW}),
    "gemma3": ("gemma3_text", {"sliding_window": WINDOW}),
    "olmo3": ("olmo3", {"sliding_window": WINDOW}),
    "cohere2": ("cohere2", {"sliding_window": WINDOW}),
    "qwen2-lower": (
        "qwen2",
        {
            "use_sliding_window": True,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention"] * 2 + ["full_attention"] * 2,
        },
    ),
}


@pytest.fixture(scope="module")
def windowed(tmp_path_factory, tokenizers):
    root = tmp_path_factory.mktemp("windowed")
    tok = tokenizers["qwen2"]
    return {name: save_tiny_model(root / name, fam, tokenizer=tok, **kw) for name, (fam, kw) in WINDOWED.items()}


def _reference(target, prompts: list[str], tok) -> list[list[int]]:
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    out = []
    for p in prompts:
        ids = torch.tensor([tok.encode(p)])
        assert ids.shape[1] > WINDOW  # the window cuts, in the prompt already
        got = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW)
        out.append(got[0, ids.shape[1] :].tolist())
    return out


def test_layer_windows_follow_the_configs_layer_types():
    assert layer_windows(MistralConfig(sliding_window=8, num_hidden_layers=3)) == [8, 8, 8]
    assert layer_windows(MistralConfig(sliding_window=None, num_hidden_layers=2)) == [None, None]
    qwen = Qwen2Config(use_sliding_window=True, sliding_window=16, max_window_layers=1, num_hidden_layers=3)
    assert layer_windows(qwen) == [None, 16, 16]
    assert layer_windows(Qwen2Config(num_hidden_layers=2)) == [None, None]
    long = MistralConfig(sliding_window=4096, max_position_embeddings=4096, num_hidden_layers=1)
    assert layer_windows(long) == [None]  # a window no shorter than the context cuts nothing


def test_a_windowed_mask_sees_the_last_window_positions():
    """`causal` as HF's sliding-window overlay: key j is seen by the query at position p when p - w < j <= p; the
    dynamic cache builds a mask for one token only once the window cuts."""
    got = causal(torch.arange(6), torch.tensor([3, 5]), 3)
    assert got.int().tolist() == [[0, 1, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1]]
    cache = KVCache()
    cache.keys[0] = cache.values[0] = torch.zeros(1, 1, 4, 2)
    assert cache.mask(torch.tensor([4]), None) is None and cache.mask(torch.tensor([4]), 5) is None
    assert cache.mask(torch.tensor([4]), 2)[0, 0].int().tolist() == [[0, 0, 0, 1, 1]]


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_gemma_refuses_float16_saying_what_to_run(name, windowed):
    """Gemma 2 and 3 overflow float16: the worker refuses it at load, and the plan too, naming bfloat16."""
    with pytest.raises(ModelLoadError, match=r"overflows float16.*--dtype bfloat16"):
        load_shard(windowed[name], (0, 2), embed=True, head=False, dtype=torch.float16)
    config = AutoConfig.from_pretrained(windowed[name])
    with pytest.raises(ModelLoadError, match=r"overflows float16"):
        model_shape(config, torch.float16)
    assert model_shape(config, torch.bfloat16).layers == 4


def test_other_families_with_a_window_are_refused(models, tmp_path):
    """A family whose windowed layers this engine does not know is refused at load, naming it."""
    import json
    import shutil

    shutil.copytree(models["llama"].target, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg.update(sliding_window=8, layer_types=["sliding_attention"] * cfg["num_hidden_layers"])
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"sliding-window attention .* not supported for llama"):
        load_shard(tmp_path / "m", None, embed=True, head=True)


# plain `pytest` runs three families (every layer windowed, the tail's only, a family on HF layers); CI all of them
QUICK = ("mistral", "qwen2-upper", "gemma2")


@pytest.mark.parametrize("name", [n if n in QUICK else pytest.param(n, marks=pytest.mark.slow) for n in WINDOWED])
@pytest.mark.parametrize("static", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["dynamic", "static"])
def test_windowed_models_split_equal_generate(name, static, windowed, tokenizers, tails, redis_client):
    """Greedy, n-gram and model drafts (the model itself drafting: its own windows), one at a time."""
    target, tok = windowed[name], tokenizers["qwen2"]
    prompts = PROMPTS[:4]
    expected = _reference(target, prompts, tok)
    extra = ("--static-cache",) if static else ()
    names = tails.get(target, 2, 4, extra)
    settings = Settings(engine={"static": static})
    runtime = HeadRuntime.load(target, (0, 2), draft=str(target), settings=settings)
    for prompt, want in zip(prompts, expected, strict=True):
        for kind, k in (("model", 4), ("ngram", 3)):
            req = GenerationRequest(
                prompt=prompt, max_new_tokens=NEW, chat_template=False, draft=DraftSettings(kind=kind, k=k)
            )
            assert generate(req, runtime, redis_client, names=names).token_ids == want, (name, prompt, kind)


@pytest.mark.slow
def test_windowed_generations_in_flight_equal_generate(windowed, tokenizers, tails, redis_client):
    """Several generations at once on static caches: batched forwards over their slots, each its own window."""
    target, tok = windowed["mistral"], tokenizers["qwen2"]
    prompts = PROMPTS[:6]
    expected = _reference(target, prompts, tok)
    names = tails.get(target, 2, 4, ("--static-cache",))
    runtime = HeadRuntime.load(target, (0, 2), draft=str(target), settings=Settings(engine={"static": True}))

    def one(p: str) -> list[int]:
        req = GenerationRequest(prompt=p, max_new_tokens=NEW, chat_template=False, draft=DraftSettings(k=4))
        return generate(req, runtime, redis_client, names=names).token_ids

    with ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(one, prompts)) == expected


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "olmo3"])
def test_a_whole_shards_logits_equal_the_models(name, windowed, tokenizers):
    """Every logit, not only the greedy choice (sampling reads them all): Gemma 2's final soft cap, Gemma's scaled
    embedding and a rotary per layer type as the HF model applies them."""
    target, tok = windowed[name], tokenizers["qwen2"]
    ids = torch.tensor(tok.encode(PROMPTS[0]))
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    shard = load_shard(target, None, embed=True, head=True)
    with torch.inference_mode():
        want = hf(ids[None]).logits[0]
        got = shard.forward(ids, 0, KVCache(), logits_last=ids.shape[0])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mistral", "gemma3"])
def test_prompts_longer_than_the_rings_equal_generate(name, windowed, tokenizers, tails, redis_client):
    """Static caches keep a windowed layer's keys in a ring of window + engine.window_slack (8 + 80: 96 positions,
    workers/engine/rings.py): prompts of over 100 tokens (the long form), then rounds, rejections rolled back and
    the ring wrapping, fused layers (Mistral) and HF layers (Gemma 3: 5 local : 1 global), in flight, as `generate`."""
    target, tok = windowed[name], tokenizers["qwen2"]
    prompts = [" ".join(PROMPTS[i:] + PROMPTS[:i]) for i in range(3)]
    assert all(len(tok.encode(p)) > 100 for p in prompts)
    expected = _reference(target, prompts, tok)
    names = tails.get(target, 2, 4, ("--static-cache",))
    runtime = HeadRuntime.load(target, (0, 2), draft=str(target), settings=Settings(engine={"static": True}))
    assert runtime.engine.pool is not None and runtime.engine.pool.rings  # the head's windowed layers: rings

    def one(p: str) -> list[int]:
        req = GenerationRequest(prompt=p, max_new_tokens=NEW, chat_template=False, draft=DraftSettings(k=4))
        return generate(req, runtime, redis_client, names=names).token_ids

    with ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(one, prompts)) == expected
