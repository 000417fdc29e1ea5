"""Multimodal wrappers (Gemma 3, Qwen3.5, Mistral 3: a text model beside a vision tower, saved as each wrapper saves
itself): a shard loads only its text layers, under the wrapper's names (workers/engine/wrappers.py), and equals the
wrapper's own forward on text; a split generation with a real tail process equals the wrapper's `generate`; the plan
reads the text model's shape."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForImageTextToText

from schemas.requests import DraftSettings, GenerationRequest
from schemas.settings import Settings
from tests.conftest import PROMPTS
from workers.engine.plan import GiB, plan_split
from workers.engine.shard import load_shard
from workers.head.runtime import HeadRuntime, generate
from workers.plugins import Registry
from workers.tiny_models import WRAPPERS, save_tiny_wrapper

NEW = 12
QUICK = ("gemma3",)  # generate through a tail process in plain `pytest`; CI runs every wrapper


@pytest.fixture(scope="module")
def wrapped(tmp_path_factory, tokenizers):
    root = tmp_path_factory.mktemp("wrappers")
    return {w: save_tiny_wrapper(root / w, w, tokenizer=tokenizers["qwen2"]) for w in WRAPPERS}


def _hf(target):
    return AutoModelForImageTextToText.from_pretrained(target, dtype=torch.float32).eval()


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_a_wrappers_text_shards_equal_its_forward(wrapper, wrapped, tokenizers):
    target, tok = wrapped[wrapper], tokenizers["qwen2"]
    ids = torch.tensor(tok.encode(PROMPTS[1]))
    with torch.inference_mode():
        want = _hf(target)(input_ids=ids[None]).logits[0]
        for split in (1, 3):
            head = load_shard(target, (0, split), embed=True, head=False)
            tail = load_shard(target, (split, 4), embed=False, head=True)
            got = tail.forward(head.forward(ids, 0, head.new_cache()), 0, tail.new_cache(), logits_last=len(ids))
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"{wrapper} split {split}")
    assert type(head.config).__name__ != type(_hf(target).config).__name__  # the text model's config
    names = [n for n, _ in head.named_parameters()] + [n for n, _ in tail.named_parameters()]
    assert not any("vision" in n or "projector" in n for n in names)
    config = Registry().config(target)  # what `shardflow plan` and the workers' preflight read
    assert (
        plan_split(config, [GiB, GiB], dtype=torch.float32, settings=Settings(engine={"cuda_context_gib": 0})).in_flight
        > 0
    )


@pytest.mark.parametrize("wrapper", [w if w in QUICK else pytest.param(w, marks=pytest.mark.slow) for w in WRAPPERS])
def test_a_split_wrapper_generates_as_it_does(wrapper, wrapped, tokenizers, tails, redis_client):
    target, tok = wrapped[wrapper], tokenizers["qwen2"]
    hf, names = _hf(target), tails.get(target, 2, 4)
    runtime = HeadRuntime.load(target, (0, 2), draft=str(target))
    ids = torch.tensor([tok.encode(PROMPTS[0])])
    want = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW)
    for kind, k in (("model", 4), ("ngram", 3)):
        req = GenerationRequest(
            prompt=PROMPTS[0], max_new_tokens=NEW, chat_template=False, draft=DraftSettings(kind=kind, k=k)
        )
        assert generate(req, runtime, redis_client, names=names).token_ids == want[0, ids.shape[1] :].tolist(), kind
