"""The head's step loop takes replies while the device runs a group's whole draft and its lower shard
(`HeadLoop._take_meanwhile`): with two groups in flight, the replies of one are committed while the other computes,
and every generation still equals HF generate (a real tail process; the head in-process)."""

from __future__ import annotations

import itertools
import time
from concurrent.futures import ThreadPoolExecutor

from schemas.requests import GenerationRequest
from schemas.settings import Settings
from tests.conftest import PROMPTS
from tests.job_env import reference
from workers.engine.runner import Engine
from workers.head.loop import HeadLoop
from workers.head.runtime import HeadRuntime, generate

NEW = 8


def test_replies_taken_while_a_group_computes_change_nothing(
    models, tails, redis_client, hf_models, tokenizers, monkeypatch
):
    ms = models["qwen2"]
    names = tails.get(ms.target, 2, ms.n_layers)
    runtime = HeadRuntime.load(ms.target, (0, 2), settings=Settings(relay={"head_groups": 2}))
    taken: list[int] = []
    forward, meanwhile = Engine.forward_many, HeadLoop._take_meanwhile

    def slow_forward(self: Engine, *args, **kwargs):  # the lower shard "runs" a while: replies come meanwhile
        out = forward(self, *args, **kwargs)
        if self is runtime.engine:
            time.sleep(0.05)
        return out

    def counting(self: HeadLoop, wait_s: float) -> None:
        with self._cv:
            taken.append(len(self._inbox.replies))
        meanwhile(self, wait_s)

    monkeypatch.setattr(Engine, "forward_many", slow_forward)
    monkeypatch.setattr(HeadLoop, "_take_meanwhile", counting)
    prompts = PROMPTS[:8]

    def one(p: str) -> list[int]:
        req = GenerationRequest(prompt=p, max_new_tokens=NEW, chat_template=False)
        return generate(req, runtime, redis_client, names=names).token_ids

    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(one, prompts))
    assert got == [reference(hf_models["qwen2"], tokenizers["qwen2"], p, NEW) for p in prompts]
    assert taken and sum(taken) > 0, taken  # some replies were taken while a group computed


def test_replies_taken_while_a_whole_draft_runs(models, tails, redis_client, hf_models, tokenizers, monkeypatch):
    """With a draft model on static caches (its whole greedy draft one `Engine.draft_many`), the loop also takes
    replies while the draft runs, before it is read back: the lower shard is queued behind the draft before the
    drafts are read (`Drafted`, workers/head/drafts.py), replies are taken once both are queued, the rounds'
    headers are made while the lower shard runs (`Generation.prepare`), and every generation still equals HF
    generate."""
    from schemas.requests import DraftSettings

    ms = models["qwen2"]
    names = tails.get(ms.target, 2, ms.n_layers)
    settings = Settings(engine={"static": True, "slots": 8}, relay={"head_groups": 2})
    runtime = HeadRuntime.load(ms.target, (0, 2), draft=ms.drafter, settings=settings)
    during_draft: list[int] = []
    draft_many, meanwhile, forward = Engine.draft_many, HeadLoop._take_meanwhile, Engine.forward_many
    drafting = [False]
    order: list[str] = []  # per group: the lower shard queued, then the drafts read

    def lower(self: Engine, *args, **kwargs):
        if self is runtime.engine:
            order.append("lower")
        return forward(self, *args, **kwargs)

    from workers.speculative.drafters import GreedyLaunch

    read = GreedyLaunch.drafts

    def reading(self: GreedyLaunch):
        if self.queued:
            order.append("read")
        return read(self)

    def slow_draft(self: Engine, *args, **kwargs):  # the whole draft "runs" a while: replies come meanwhile
        out = draft_many(self, *args, **kwargs)
        drafting[0] = out is not None
        time.sleep(0.03)
        return out

    def counting(self: HeadLoop, wait_s: float) -> None:
        if drafting[0]:
            with self._cv:
                during_draft.append(len(self._inbox.replies))
            drafting[0] = False
        meanwhile(self, wait_s)

    from workers.head import sealing as rounds

    ahead, round_fields = [0], rounds.round_fields

    def sealing(*args, **kwargs):  # a round sealed under the header the loop made while its forward ran
        ahead[0] += 1
        return round_fields(*args, **kwargs)

    monkeypatch.setattr(Engine, "draft_many", slow_draft)
    monkeypatch.setattr(Engine, "forward_many", lower)
    monkeypatch.setattr(GreedyLaunch, "drafts", reading)
    monkeypatch.setattr(HeadLoop, "_take_meanwhile", counting)
    monkeypatch.setattr(rounds, "round_fields", sealing)
    prompts = PROMPTS[:8]

    def one(p: str) -> list[int]:
        req = GenerationRequest(prompt=p, max_new_tokens=NEW, chat_template=False, draft=DraftSettings(k=4))
        return generate(req, runtime, redis_client, names=names).token_ids

    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(one, prompts))
    assert got == [reference(hf_models["qwen2"], tokenizers["qwen2"], p, NEW) for p in prompts]
    assert during_draft and sum(during_draft) > 0, during_draft  # replies taken while a draft ran
    assert ahead[0] > len(prompts)  # headers made while the lower shard ran, then sealed as they were
    pairs = [(a, b) for a, b in itertools.pairwise(order) if b == "read"]
    assert pairs and all(a == "lower" for a, _ in pairs), order  # drafts read only once the lower shard was queued
