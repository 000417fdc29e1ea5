"""The head's step loop takes replies while the device runs a group's lower shard (`HeadLoop._meanwhile`): with two
groups in flight, the replies of one are committed while the other computes, and every generation still equals
HF generate (a real tail process; the head in-process)."""

from __future__ import annotations

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
    forward, meanwhile = Engine.forward_many, HeadLoop._meanwhile

    def slow_forward(self: Engine, *args, **kwargs):  # the lower shard "runs" a while: replies come meanwhile
        out = forward(self, *args, **kwargs)
        if self is runtime.engine:
            time.sleep(0.05)
        return out

    def counting(self: HeadLoop) -> None:
        with self._cv:
            taken.append(len(self._replies))
        meanwhile(self)

    monkeypatch.setattr(Engine, "forward_many", slow_forward)
    monkeypatch.setattr(HeadLoop, "_meanwhile", counting)
    prompts = PROMPTS[:8]

    def one(p: str) -> list[int]:
        req = GenerationRequest(prompt=p, max_new_tokens=NEW, chat_template=False)
        return generate(req, runtime, redis_client, names=names).token_ids

    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(one, prompts))
    assert got == [reference(hf_models["qwen2"], tokenizers["qwen2"], p, NEW) for p in prompts]
    assert taken and sum(taken) > 0, taken  # some replies were taken while a group computed
