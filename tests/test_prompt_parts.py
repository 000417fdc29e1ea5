"""Long prompts over the packet cap (workers/head/sealing.py `part_tokens`): a prompt, or a replay, whose hidden rows
would pass half a tail's packet cap goes in parts, rounds of their own that carry a part and commit nothing; each
generation equals HF generate, a verdict lost on its way is replayed in parts, a prompt longer than the tail's cache
is refused at its first part, and a seeded sampled generation samples the same text in parts or whole (real tail
processes)."""

from __future__ import annotations

import pytest

from schemas.requests import SamplingParams


def _long_prompt(tok) -> str:
    """The test prompts joined, doubled until they make at least 300 tokens (more than a part of 40 holds, 7 times)."""
    from tests.conftest import PROMPTS

    prompt = " ".join(PROMPTS)
    while len(tok(prompt).input_ids) < 300:
        prompt += " " + prompt
    return prompt


def _spy_headers(monkeypatch) -> list[tuple[int, int, bool]]:
    """(start_pos, prefill_more, replay) of every round header the head makes from now on."""
    from workers.head.generation import Generation

    sent: list[tuple[int, int, bool]] = []
    fields = Generation._header_fields

    def header_fields(self: Generation) -> tuple:
        basis, header, q = fields(self)
        sent.append((header["start_pos"], header["prefill_more"], header["replay"]))
        return basis, header, q

    monkeypatch.setattr(Generation, "_header_fields", header_fields)
    return sent


def test_a_prompt_past_the_packet_cap_goes_in_parts(models, tails, redis_client, hf_models, tokenizers, monkeypatch):
    """A prompt whose hidden rows would pass half the tail's packet cap goes in parts: rounds of their own that carry
    a part of it (`prefill_more`: no drafts, nothing committed), the drafts from its last part on. With a cap of
    54,000 bytes (105 rows of a 64-wide float32 model) a part holds 40 tokens (room left for a round's drafts), so a
    prompt of over 300 tokens (which alone would exceed the cap and be refused) goes in 8 parts or more; its
    generation equals HF generate, beside a short prompt's."""
    from schemas.requests import DraftSettings, GenerationRequest
    from schemas.settings import Settings
    from tests.conftest import PROMPTS
    from tests.job_env import reference
    from workers.head.runtime import HeadRuntime, generate
    from workers.head.sealing import part_tokens

    ms, cap, tok = models["qwen2"], 54_000, tokenizers["qwen2"]
    settings = Settings(relay={"max_packet_bytes": cap})
    assert part_tokens(300, 256, 64, settings.relay) == 40 and part_tokens(41, 256, 64, settings.relay) == 39
    wide = Settings(relay={"max_packet_bytes": 1 << 30}).relay  # narrow rows: the ids' JSON bounds a part
    assert part_tokens(1 << 20, 2, 1, wide) == wide.max_header_bytes // 16 - 65
    names = tails.get(ms.target, 2, ms.n_layers, ("--max-packet-bytes", str(cap)))
    runtime = HeadRuntime.load(ms.target, (0, 2), draft=ms.drafter, settings=settings)
    long = _long_prompt(tok)
    for prompt in (long, PROMPTS[0]):
        sent = _spy_headers(monkeypatch)
        req = GenerationRequest(prompt=prompt, max_new_tokens=12, chat_template=False, draft=DraftSettings(k=4))
        got = generate(req, runtime, redis_client, names=names)
        assert got.token_ids == reference(hf_models["qwen2"], tok, prompt, 12)
        parts = [s for s in dict.fromkeys(sent) if s[1] > 0]  # (start, tokens still to come, replay) of each
        n = len(tok(prompt).input_ids)
        assert [start for start, _, _ in parts] == list(range(0, 40 * len(parts), 40)) and len(parts) == -(-n // 40) - 1
        assert got.rounds <= 12  # decoding rounds: the parts are not counted as rounds


def test_a_replay_past_the_packet_cap_goes_in_parts(models, tails, redis_client, hf_models, tokenizers, monkeypatch):
    """A session replayed onto a tail (here a job resumed from its checkpoint's 5 tokens) whose committed tokens pass
    the cap goes in parts too: the first opens the session at position 0, the last (at a later position) is the
    replay, whose check reproduces its last committed token; the output equals HF generate."""
    from schemas.requests import DraftSettings, GenerationRequest
    from schemas.settings import Settings
    from tests.job_env import reference
    from workers.head.generation import Generation
    from workers.head.runtime import HeadRuntime

    ms, cap, tok = models["qwen2"], 54_000, tokenizers["qwen2"]
    names = tails.get(ms.target, 2, ms.n_layers, ("--max-packet-bytes", str(cap)))
    runtime = HeadRuntime.load(ms.target, (0, 2), draft=ms.drafter, settings=Settings(relay={"max_packet_bytes": cap}))
    prompt = _long_prompt(tok)
    want = reference(hf_models["qwen2"], tok, prompt, 12)
    sent = _spy_headers(monkeypatch)
    req = GenerationRequest(prompt=prompt, max_new_tokens=12, chat_template=False, draft=DraftSettings(k=4))
    ids = runtime.prompt_ids(req)
    loop = Generation(
        req=req, runtime=runtime, r=redis_client, names=names, session_id="replay-in-parts", prompt=ids,
        on_tokens=None, reply_timeout_s=None, resume=want[:5],
    )  # fmt: skip
    result = loop.run()
    assert result.token_ids == want and result.resumed_tokens == 5
    opened = [s for s in dict.fromkeys(sent) if s[1] > 0]
    assert opened[0] == (0, len(ids) + 5 - 40, False) and len(opened) >= 8
    replay = next(s for s in dict.fromkeys(sent) if s[2])
    assert replay[0] > 0 and replay[1] == 0  # the last part replays, past position 0


@pytest.mark.parametrize("lost", ["a decoding round's", "a middle part's"])
def test_a_verdict_lost_on_its_way_then_a_replay_in_parts(
    lost, models, tails, redis_client, hf_models, tokenizers, monkeypatch
):
    """A verdict the tail sent but the head never took (here dropped on the head): after the reply timeout the head
    replays the session in parts onto the same tail, under the id of the round it missed. The tail had answered
    that id, for another packet: the replay's first part (at position 0) opens the session again rather than
    getting the stored verdict back as a duplicate. One replay allowed: the output equals HF generate."""
    from schemas.requests import DraftSettings, GenerationRequest
    from schemas.settings import Settings
    from tests.job_env import reference
    from workers.head.generation import Generation
    from workers.head.runtime import HeadRuntime

    ms, cap, tok = models["qwen2"], 54_000, tokenizers["qwen2"]
    names = tails.get(ms.target, 2, ms.n_layers, ("--max-packet-bytes", str(cap)))
    settings = Settings(relay={"max_packet_bytes": cap, "resume_attempts": 1})
    runtime = HeadRuntime.load(ms.target, (0, 2), draft=ms.drafter, settings=settings)
    prompt = _long_prompt(tok)
    take, dropped = Generation.take, []

    def lossy(self: Generation, entry_id: bytes, fields: dict) -> dict | None:
        assert self.round is not None
        hit = (
            self.generated and not self.round.more
            if lost.startswith("a decoding")
            else self.round.more and self.parts == 2
        )
        if hit and not dropped:
            dropped.append(self.round.rid)
            return None
        return take(self, entry_id, fields)

    monkeypatch.setattr(Generation, "take", lossy)
    req = GenerationRequest(prompt=prompt, max_new_tokens=12, chat_template=False, draft=DraftSettings(k=4))
    loop = Generation(
        req=req, runtime=runtime, r=redis_client, names=names, session_id=f"lost-{len(lost)}",
        prompt=runtime.prompt_ids(req), on_tokens=None, reply_timeout_s=1.5,
    )  # fmt: skip
    result = loop.run()
    assert dropped and result.replays == 1
    assert result.token_ids == reference(hf_models["qwen2"], tok, prompt, 12)


def test_a_prompt_in_parts_longer_than_the_tails_cache_is_refused_at_its_first_part(
    models, tails, redis_client, monkeypatch
):
    """A tail whose cache holds fewer positions than a prompt in parts refuses its first part (which says how much
    is still to come), not the part that would cross the end: no part is computed for nothing, on any replay."""
    from schemas.errors import RemoteError
    from schemas.requests import GenerationRequest
    from schemas.settings import Settings
    from workers.head.runtime import HeadRuntime, generate

    ms, cap = models["qwen2"], 54_000
    names = tails.get(ms.target, 2, ms.n_layers, ("--max-packet-bytes", str(cap), "--max-len", "200"))
    runtime = HeadRuntime.load(
        ms.target, (0, 2), settings=Settings(relay={"max_packet_bytes": cap, "resume_attempts": 1})
    )
    prompt = _long_prompt(runtime.tokenizer)
    sent = _spy_headers(monkeypatch)
    with pytest.raises(RemoteError, match="beyond this tail's cache of 200"):
        generate(
            GenerationRequest(prompt=prompt, max_new_tokens=4, chat_template=False), runtime, redis_client, names=names
        )
    assert {start for start, _, _ in sent} == {0}  # each attempt's first part, never a later one


def test_a_seeded_sampled_generation_samples_the_same_text_in_parts_or_whole(models, tails, redis_client):
    """Parts take round ids but draw nothing (`seed_round`): a seeded sampled generation whose prompt goes in parts
    (a 54,000-byte cap) samples the same text as with the prompt in one round (a 64 MiB cap)."""
    from schemas.requests import DraftSettings, GenerationRequest
    from schemas.settings import Settings
    from workers.head.runtime import HeadRuntime, generate

    ms, outs = models["qwen2"], []
    sampling = SamplingParams(temperature=1.0, seed=7)
    for cap in (54_000, 64 << 20):
        names = tails.get(ms.target, 2, ms.n_layers, ("--max-packet-bytes", str(cap)))
        relay = {"max_packet_bytes": cap}
        runtime = HeadRuntime.load(ms.target, (0, 2), draft=ms.drafter, settings=Settings(relay=relay))
        prompt = _long_prompt(runtime.tokenizer)
        draft = DraftSettings(k=4)
        req = GenerationRequest(prompt=prompt, max_new_tokens=16, chat_template=False, draft=draft, sampling=sampling)
        outs.append(generate(req, runtime, redis_client, names=names).token_ids)
    assert outs[0] == outs[1] and len(outs[0]) == 16
