"""One worker over several local devices (`--devices`, workers/engine/chain.py), on this CPU's one device named twice:
a head spanning two parts (and its drafter) and a tail process spanning two give greedy output equal to HF generate,
and sampled output that passes the χ² test against the target's exact distribution; the cuts hold about equal
weights; a chain's caches are acquired and released together."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from schemas.requests import DraftSettings, GenerationRequest, SamplingParams
from schemas.settings import Settings
from tests.conftest import PROMPTS
from tests.job_env import reference
from tests.test_sampling import VOCAB, chi2_pvalue, exact_distribution, sample_draws
from workers.engine.chain import ChainShard, EngineChain, device_ranges
from workers.tiny_models import save_noisy_copy, save_tiny_model

TWO = Settings(engine={"devices": ["cpu", "cpu"]})
SPAN = ("--devices", "cpu,cpu")


def test_the_cuts_hold_about_equal_weights(models):
    """Equal layers split evenly; the embedding and the LM head count on the part that holds them."""
    from workers.plugins import Registry

    config = Registry().config(models["qwen2"].target)
    n = config.num_hidden_layers
    assert device_ranges(config, (0, n), 2, embed=False, head=False) == [(0, n // 2), (n // 2, n)]
    with_embed = device_ranges(config, (0, n), 2, embed=True, head=False)
    assert with_embed[0][1] <= n // 2 and [r for part in with_embed for r in part][1:-1] == [with_embed[0][1]] * 2
    with pytest.raises(ValueError, match="at least one layer"):
        device_ranges(config, (0, 1), 2, embed=False, head=False)


def test_a_head_and_a_tail_over_two_devices_equal_hf_generate(models, tails, redis_client, hf_models, tokenizers):
    from workers.head.runtime import HeadRuntime, new_generation

    ms = models["qwen2"]
    split = ms.n_layers // 2
    names = tails.get(ms.target, split, ms.n_layers, extra=SPAN)
    runtime = HeadRuntime.load(ms.target, (0, split), draft=ms.drafter, settings=TWO)
    assert isinstance(runtime.shard, ChainShard) and isinstance(runtime.engine, EngineChain)
    assert len(runtime.shard.parts) == 2 and runtime.shard.layer_range == (0, split)
    prompts = PROMPTS[:6]

    def one(p: str) -> list[int]:
        req = GenerationRequest(prompt=p, max_new_tokens=8, chat_template=False, draft=DraftSettings(k=3))
        return new_generation(req, runtime, redis_client, names=names).run().token_ids

    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(one, prompts))
    assert got == [reference(hf_models["qwen2"], tokenizers["qwen2"], p, 8) for p in prompts]
    assert {e.pool.free for e in runtime.engine.parts if e.pool is not None} == {runtime.engine.slots}  # all back


def test_sampling_through_two_devices_matches_the_targets_distribution(tmp_path_factory, tails, redis_client):
    from workers.head.runtime import HeadRuntime

    root = tmp_path_factory.mktemp("devices")
    target = save_tiny_model(root / "t", "qwen2", vocab_size=VOCAB, layers=4, hidden=32, init=0.15, seed=3)
    drafter = save_noisy_copy(target, root / "d", 0.6)
    names = tails.get(target, 2, 4, extra=SPAN)
    runtime = HeadRuntime.load(target, (0, 2), draft=drafter, settings=TWO)
    runtime.eos_token_ids = []
    s, draws = SamplingParams(temperature=0.9, top_k=4), 800
    counts, accepted, drafted = sample_draws(runtime, redis_client, names, s, "model", draws)
    assert 0 < accepted < drafted
    assert chi2_pvalue(counts, exact_distribution(target, s), draws) > 1e-3


def test_the_preflight_checks_each_device_for_the_part_it_will_hold(models):
    """A worker over two GPUs is checked device by device as it will load: its cuts, its drafter on the first."""
    from workers.engine.preflight import Load, per_device
    from workers.plugins import Registry

    ms, registry = models["qwen2"], Registry()
    settings = Settings(engine={"devices": ["cuda:0", "cuda:1"]})
    own, drafter = Load(str(ms.target), (0, ms.n_layers), True, False), Load(str(ms.drafter), None, True, True)
    got = per_device(registry, own, [drafter], settings)
    assert [d for d, _ in got] == ["cuda:0", "cuda:1"]
    (first, last) = (loads for _, loads in got)
    assert first[1] == drafter and first[0].embed and not last[0].embed and len(last) == 1
    assert first[0].layers[0] == 0 and first[0].layers[1] == last[0].layers[0] and last[0].layers[1] == ms.n_layers
    assert per_device(registry, own, [drafter], Settings()) == [("cpu", [own, drafter])]
