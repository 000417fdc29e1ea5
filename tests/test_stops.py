"""Exact stops: EOS inside accepted drafts, stop strings and max_new_tokens match HF `generate`."""

from __future__ import annotations

import pytest
import torch

from schemas.keys import Keys
from schemas.requests import DraftSettings, GenerationRequest
from schemas.settings import Settings
from tests.conftest import PROMPTS
from workers.head.runtime import HeadRuntime, generate

FAMILY, SPLIT = "qwen2", 2


@pytest.fixture(scope="module")
def setup(models, hf_models, tokenizers, tails):
    ms = models[FAMILY]
    names = tails.get(ms.target, SPLIT, ms.n_layers)
    same = HeadRuntime.load(ms.target, (0, SPLIT), draft=ms.same)
    noisy = HeadRuntime.load(ms.target, (0, SPLIT), draft=ms.drafter)
    return ms, names, same, noisy, hf_models[FAMILY], tokenizers[FAMILY]


def hf_generate(hf, tok, prompt: str, **kw) -> list[int]:
    ids = torch.tensor([tok.encode(prompt)])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, **kw)
    return out[0, ids.shape[1] :].tolist()


def test_eos_inside_accepted_drafts(setup, redis_client):
    _, names, same, _, hf, tok = setup
    checked = 0
    for prompt in PROMPTS[:8]:
        ref = hf_generate(hf, tok, prompt, max_new_tokens=12)
        pos = next((i for i in range(3, 8) if ref[i] not in ref[:i]), None)
        if pos is None:
            continue
        eos = ref[pos]
        want = hf_generate(hf, tok, prompt, max_new_tokens=12, eos_token_id=eos, pad_token_id=eos)
        assert want == ref[: pos + 1]
        same.eos_token_ids = [eos]
        try:
            req = GenerationRequest(prompt=prompt, max_new_tokens=12, chat_template=False, draft=DraftSettings(k=8))
            got = generate(req, same, redis_client, names=names)
        finally:
            same.eos_token_ids = [0]
        assert got.token_ids == want
        assert got.finish_reason == "eos"
        assert got.rounds == 1 and got.accepted_tokens >= pos  # EOS sat inside the accepted drafts
        checked += 1
    assert checked >= 4


def test_stop_strings(setup, redis_client):
    _, names, _, noisy, hf, tok = setup
    checked = 0
    for prompt in PROMPTS:
        ref = hf_generate(hf, tok, prompt, max_new_tokens=20)
        pieces = [(i, tok.decode([t])) for i, t in enumerate(ref)]
        hit = next(
            ((i, s) for i, s in pieces if i >= 2 and len(s.strip()) >= 2 and s.isascii() and s.strip().isalnum()), None
        )
        if hit is None:
            continue
        stop = hit[1].strip()
        want = hf_generate(hf, tok, prompt, max_new_tokens=20, stop_strings=[stop], tokenizer=tok)
        req = GenerationRequest(
            prompt=prompt, max_new_tokens=20, chat_template=False, stop=[stop], draft=DraftSettings(k=4)
        )
        got = generate(req, noisy, redis_client, names=names)
        assert got.token_ids == want, f"{prompt!r} stop {stop!r}"
        assert got.finish_reason == "stop" and len(want) < 20
        assert got.text.endswith(stop)
        checked += 1
        if checked == 5:
            break
    assert checked >= 3


@pytest.mark.parametrize("k", [4, 8])
def test_max_new_tokens_exact(setup, redis_client, k):
    _, names, same, noisy, hf, tok = setup
    prompt = PROMPTS[0]
    ref = hf_generate(hf, tok, prompt, max_new_tokens=10)
    for n in range(1, 11):
        for runtime in (same, noisy):
            req = GenerationRequest(prompt=prompt, max_new_tokens=n, chat_template=False, draft=DraftSettings(k=k))
            got = generate(req, runtime, redis_client, names=names)
            assert got.token_ids == ref[:n]
            assert got.completion_tokens == n and got.finish_reason == "length"


def test_session_end_needs_no_close_unless_the_head_stopped(setup, redis_client):
    """A final verdict ends the session on the tail: the head sends no close; a stop the head finds itself
    (stop strings) closes the session. Replies come on the head's own stream (none per session), which
    expires after its last reply."""
    _, names, same, _, _, _ = setup
    req = GenerationRequest(prompt=PROMPTS[0], max_new_tokens=6, chat_template=False, draft=DraftSettings(k=4))
    got = generate(req, same, redis_client, names=names, session_id="ends-by-length")
    assert got.finish_reason == "length"
    assert not redis_client.exists(names.reply("ends-by-length"))
    shared = names.reply(Keys.head_reply_to(same.beacons.ref.name, same.beacons.ref.boot))
    assert 0 < redis_client.ttl(shared) <= Settings().relay.reply_ttl_s
    stop = same.tokenizer.decode(got.token_ids[2:3]).strip() or got.text.split()[-1]
    req = req.model_copy(update={"stop": [stop], "max_new_tokens": 20})
    got = generate(req, same, redis_client, names=names, session_id="ends-by-stop")
    assert got.finish_reason == "stop"
    assert not redis_client.exists(names.reply("ends-by-stop"))
