"""float16 that never emits garbage: a shard whose values overflow fails its generation with a clear error that
names the layers and dtype (the tail checks each round's logits, the head its hidden states before sending),
never as text, and the job system does not retry it."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from rq.job import Job
from rq.serializers import JSONSerializer
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from schemas.errors import NonFiniteError
from schemas.requests import DraftSettings, GenerationRequest
from tests.job_env import Env
from workers.engine.numerics import finite_rows
from workers.head.runtime import HeadRuntime, generate


def overflowing_copy(src: Path, out: Path, layer: int) -> Path:
    """A copy of a model whose layer `layer` writes values past float16's range (fine in float32)."""
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        model.model.layers[layer].mlp.down_proj.weight.mul_(1e6)
    model.save_pretrained(out)
    PreTrainedTokenizerFast.from_pretrained(src).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def overflowing(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("overflow")
    src = models["qwen2"].target
    return {side: overflowing_copy(src, root / side, layer) for side, layer in (("head", 0), ("tail", 3))}


def request() -> GenerationRequest:
    draft = DraftSettings(k=4)
    return GenerationRequest(prompt="The quick brown fox", max_new_tokens=8, chat_template=False, draft=draft)


def test_finite_rows():
    ok = torch.ones(3, 4)
    assert finite_rows([ok, ok.clone().index_fill_(1, torch.tensor([2]), float("inf")), ok / 0 * 0]) == [
        True,
        False,
        False,
    ]
    assert finite_rows([]) == []


@pytest.mark.parametrize("side", ["head", "tail"])
def test_float16_overflow_fails_cleanly(side, overflowing, tails, redis_client):
    target = overflowing[side]
    names = tails.get(target, 2, 4, ("--dtype", "float16"))
    runtime = HeadRuntime.load(target, (0, 2), dtype=torch.float16)
    what, layers = ("hidden states", "0:2") if side == "head" else ("logits", "2:4")
    with pytest.raises(NonFiniteError, match=f"non-finite {what} after layers {layers} in float16"):
        generate(request(), runtime, redis_client, names=names)
    # the same checkpoint in float32 does not overflow: the generation runs
    ok_names = tails.get(target, 2, 4)
    assert generate(request(), HeadRuntime.load(target, (0, 2)), redis_client, names=ok_names).completion_tokens == 8


@pytest.mark.slow
def test_overflowing_job_fails_once_without_retries(overflowing, redis_server, redis_client, tmp_path):
    """Through the job path: the job fails with the reason, no text, and RQ does not retry it."""
    ms = {"qwen2": SimpleNamespace(target=overflowing["tail"], n_layers=4)}
    e = Env("nan", ms, redis_server, redis_client, tmp_path, ["--dtype", "float16"], ("--dtype", "float16"))
    try:
        res = e.cli("enqueue", "Tokyo", "--no-chat-template", "--retries", "3", "--wait", "--json", "--timeout", "60")
        assert res.exit_code == 1, res.output
        job = json.loads(res.output.splitlines()[-1])["jobs"][0]
        assert job["status"] == "failed" and job["result"] is None
        assert "NonFiniteError" in job["error"] and "layers 2:4 in float16" in job["error"], job
        rq_job = Job.fetch(job["job_id"], connection=e.r, serializer=JSONSerializer)
        assert rq_job.retries_left == 0 and rq_job.get_status() == "failed"  # asked for 3 retries, got none
    finally:
        e.close()
