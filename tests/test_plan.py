"""The memory plan (workers/engine/plan.py, `shardflow plan`): weights from the config alone equal what the
loader holds, the split follows memory, a worker refuses at start a budget it cannot fit."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoConfig

from producer.cli import main
from producer.cli_plan import parse_size
from schemas.settings import Settings
from workers.engine import preflight
from workers.engine.plan import GiB, model_shape, plan_split, shard_weights
from workers.engine.shard import load_shard


@pytest.mark.parametrize("quant", ["none", "int8", "4bit"])
@pytest.mark.parametrize("part", [((0, 2), True, False), ((2, 4), False, True), (None, True, True)])
def test_planned_weights_are_what_the_loader_holds(models, quant, part):
    layers, embed, head = part
    for family in ("qwen2", "llama"):  # untied and tied LM heads
        path = models[family].target
        config = AutoConfig.from_pretrained(path)
        planned = shard_weights(model_shape(config, torch.float32, quant), layers or (0, 4), embed=embed, head=head)
        held = load_shard(path, layers, embed=embed, head=head, quant=quant).weight_bytes()
        assert abs(planned - held) <= 0.02 * held, (family, planned, held)


def test_split_follows_memory(models):
    config = AutoConfig.from_pretrained(models["qwen2"].target)
    cfg = Settings(engine={"cuda_context_gib": 0})
    even = plan_split(config, [GiB, GiB], dtype=torch.float32, settings=cfg)
    assert [w.role for w in even.workers] == ["head", "tail"] and even.workers[0].layers == (0, 2)
    small_head = plan_split(config, [GiB, 4 * GiB], dtype=torch.float32, settings=cfg)  # less room beside workspace
    assert small_head.workers[0].layers[1] < 2  # fewer layers where there is less memory
    for w in even.workers:
        assert w.slots > 0 and w.expected <= w.budget
    draft = AutoConfig.from_pretrained(models["qwen2"].drafter)
    with_draft = plan_split(config, [GiB, GiB, GiB], dtype=torch.float32, draft=draft, settings=cfg)
    assert [w.role for w in with_draft.workers] == ["head", "draft", "tail"]
    assert with_draft.in_flight == min(w.slots for w in with_draft.workers)
    d = with_draft.workers[1]  # a slot: its keys/values, their copy for a whole draft, and its row of a forward
    assert d.full_slot > 2 * d.kv_slot[0] and d.short_slot >= 2 * d.kv_slot[1]


def test_parse_size():
    assert parse_size("15GiB") == 15 * GiB and parse_size("16GB") == 16 * 10**9 and parse_size("1.5") == GiB * 3 // 2
    assert parse_size("512 MiB") == 512 << 20


def test_plan_command(models):
    runner = CliRunner()
    args = ["plan", "--target", str(models["qwen2"].target), "--draft", str(models["qwen2"].drafter)]
    res = runner.invoke(main, [*args, "--gpus", "4GiB,4GiB", "--quant", "4bit"])
    assert res.exit_code == 0, res.output
    assert "layers quantized 4bit" in res.output and "head" in res.output and "tail" in res.output
    res = runner.invoke(main, [*args[:3], "--gpus", "4GiB,4GiB", "--json"])
    plan = json.loads(res.output)
    assert [w["layers"] for w in plan["workers"]] == [[0, 2], [2, 4]] and plan["in_flight"] > 0
    with_draft = json.loads(runner.invoke(main, [*args, "--gpus", "4GiB,4GiB", "--json"]).output)
    assert with_draft["workers"][0]["layers"][1] <= 2  # the drafter's caches share the head's GPU
    res = runner.invoke(main, [*args, "--gpus", "1MiB,1MiB"])
    assert res.exit_code == 2 and "does not fit" in res.output
    res = runner.invoke(main, [*args, "--gpus", "1GiB"])
    assert res.exit_code == 2 and "give 2 sizes" in res.output


@pytest.mark.parametrize("role", ["tail", "head"])
def test_worker_refuses_a_budget_it_cannot_fit(role):
    """Before anything loads (a 7B-shaped target on this CPU, only its config is read): one line with the
    numbers, exit 2."""
    layers = "14:28" if role == "tail" else "0:14"
    args = [role, "--plugin", "bench.synthetic", "--target", "random:qwen2.5-7b", "--layers", layers]
    flags = ["--gpu-memory", "4", "--dtype", "bfloat16", "--redis-url", "redis://127.0.0.1:1/0"]
    res = CliRunner().invoke(main, [*args, *flags])
    assert res.exit_code == 2, res.output
    assert f"the {role} does not fit its memory budget: weights 7." in res.output and "budget 4.00 GiB" in res.output


def test_a_drafter_on_its_own_device_is_checked_against_that_budget(monkeypatch):
    """`--draft-device`: the head's layers and its drafter are checked each against its own device's budget when
    the devices differ, together when they are one ("cuda" is cuda:0), before anything loads."""
    args = ["head", "--plugin", "bench.synthetic", "--target", "random:qwen2.5-7b", "--layers", "0:1"]
    args += ["--draft", "random:qwen2.5-14b", "--gpu-memory", "4", "--dtype", "bfloat16"]
    args += ["--redis-url", "redis://127.0.0.1:1/0"]
    together = CliRunner().invoke(main, [*args, "--device", "cpu", "--draft-device", "cpu:0"])
    assert together.exit_code == 2 and "the head does not fit its memory budget" in together.output, together.output
    checked: list[tuple[str, str, int]] = []
    monkeypatch.setattr(
        preflight, "preflight", lambda role, _r, parts, device, *_: checked.append((role, device, len(parts)))
    )
    for device, draft_device in (("cuda", "cuda:0"), ("cuda:1", "cuda:1"), ("cuda:0", None), ("cuda:0", "cuda:1")):
        settings = Settings(engine={"device": device, "draft_device": draft_device})
        preflight.preflight_head(None, "t", (0, 1), "d", settings)  # type: ignore[arg-type]
    assert checked[:3] == [("head", "cuda", 2), ("head", "cuda:1", 2), ("head", "cuda:0", 2)]
    assert checked[3:] == [("head", "cuda:0", 1), ("head's drafter", "cuda:1", 1)]
