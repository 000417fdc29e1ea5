"""The one Settings (schemas/settings.py): groups by concern, one environment name per field (nested), flags on
top; carried by processes, never read as a global by the schemas; a request's k apart from the engines' shapes."""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import click
import pytest
import torch

from producer import options
from producer.local import wait_for_tails
from schemas.keys import Keys
from schemas.requests import DraftSettings, GenerationRequest
from schemas.settings import ApiSettings, EngineSettings, GenerationSettings, JobSettings, RedisSettings, Settings
from tests.conftest import PROMPTS
from workers.engine.runner import Engine
from workers.engine.shard import load_shard
from workers.head.runtime import HeadRuntime, generate
from workers.tail.server import TailWorker

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def clean_env(monkeypatch):
    """No SHARDFLOW_* setting from the test's own environment."""
    import os

    for name in [n for n in os.environ if n.startswith("SHARDFLOW_")]:
        monkeypatch.delenv(name)
    return monkeypatch


def test_nested_environment_names_set_each_group(clean_env):
    clean_env.setenv("SHARDFLOW_REDIS__URL", "redis://nested:1/0")
    clean_env.setenv("SHARDFLOW_ENGINE__GPU_MEMORY", "0.4")
    clean_env.setenv("SHARDFLOW_ENGINE__GRAPH_K", "3")
    clean_env.setenv("SHARDFLOW_JOBS__RETRY_INTERVALS_S", "[1, 5]")
    clean_env.setenv("SHARDFLOW_RELAY__GROUP_MESSAGES", "false")
    clean_env.setenv("SHARDFLOW_API__SHARED_BATCHES", "1")
    s = Settings()
    assert s.redis.url == "redis://nested:1/0" and s.engine.gpu_memory == 0.4 and s.engine.graph_k == 3
    assert s.jobs.retry_intervals_s == [1, 5] and s.relay.group_messages is False and s.api.shared_batches is True
    assert s.generation == GenerationSettings()  # untouched groups keep the documented defaults


def test_flags_win_over_the_environment(clean_env):
    clean_env.setenv("SHARDFLOW_ENGINE__GPU_MEMORY", "0.3")
    clean_env.setenv("SHARDFLOW_ENGINE__SLOTS", "5")
    flags = options.worker_settings(engine={"slots": 2, "gpu_memory": None}, jobs={"queue": "q-flag"})
    assert (flags.engine.slots, flags.engine.gpu_memory, flags.jobs.queue) == (2, 0.3, "q-flag")  # None: not given


def test_the_flat_names_of_0_1_and_old_field_names_set_nothing(clean_env):
    """One environment name per field: SHARDFLOW_<GROUP>__<FIELD>. The flat ones (SHARDFLOW_REDIS_URL,
    SHARDFLOW_BATCH_SLOTS, ...) are ignored, and a group refuses a field's old name."""
    for name, value in {
        "SHARDFLOW_REDIS_URL": "redis://flat:1/0",
        "SHARDFLOW_QUEUE": "q-flat",
        "SHARDFLOW_BATCH_SLOTS": "5",
        "SHARDFLOW_STATIC_CACHE_LEN": "99",
        "SHARDFLOW_GPU_MEMORY": "0.7",
        "SHARDFLOW_API_TIMEOUT_S": "9",
        "SHARDFLOW_HEARTBEAT_TTL_S": "1",
    }.items():
        clean_env.setenv(name, value)
    s = Settings()
    assert (s.redis, s.jobs, s.engine, s.api) == (RedisSettings(), JobSettings(), EngineSettings(), ApiSettings())
    with pytest.raises(ValueError, match="batch_slots"):
        Settings(engine={"batch_slots": 2})


def test_a_bad_setting_from_the_environment_is_a_usage_error(clean_env):
    clean_env.setenv("SHARDFLOW_ENGINE__GPU_MEMORY", "-1")
    with pytest.raises(click.UsageError, match="gpu_memory"):
        options.worker_settings()
    clean_env.setenv("SHARDFLOW_ENGINE__GPU_MEMORY", "0.5")
    clean_env.setenv("SHARDFLOW_ENGINE__NO_SUCH_FIELD", "1")  # a typo in a nested name is refused, not ignored
    with pytest.raises(click.UsageError):
        options.worker_settings()


def test_replace_changes_fields_validated_without_reading_the_environment_again(clean_env):
    s = Settings(engine={"slots": 4})
    clean_env.setenv("SHARDFLOW_ENGINE__MAX_LEN", "99")
    t = s.replace(engine={"cpu_slots": 3})
    assert (t.engine.slots, t.engine.cpu_slots, t.engine.max_len) == (4, 3, EngineSettings().max_len)
    with pytest.raises(ValueError):
        s.replace(engine={"gpu_memory": 0})


def _product_modules() -> list[Path]:
    return [p for pkg in ("schemas", "relay_broker", "workers", "producer") for p in (ROOT / pkg).rglob("*.py")]


def test_no_process_global_settings_are_read_at_run_time():
    """No `DEFAULTS` anywhere, and no schema module builds a process's Settings (from the environment): limits
    come from the Settings a process passes in; schema field defaults read the groups' class defaults."""
    import schemas.settings

    assert not hasattr(schemas.settings, "DEFAULTS")
    for path in _product_modules():
        tree = ast.parse(path.read_text())
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        assert "DEFAULTS" not in names, path
        if path.parent.name == "schemas" and path.name != "settings.py":
            calls = {ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
            assert "Settings" not in calls, f"{path} builds a Settings from the environment"


def test_schema_defaults_are_the_documented_ones_whatever_the_environment(clean_env):
    clean_env.setenv("SHARDFLOW_GENERATION__DRAFT_K", "3")
    clean_env.setenv("SHARDFLOW_RELAY__MAX_HEADER_BYTES", "10")
    req = GenerationRequest(prompt="x")
    assert req.draft.k == GenerationSettings().draft_k and req.max_new_tokens == GenerationSettings().max_new_tokens
    assert Keys().prefix == "shardflow"
    from schemas.openai import body_for

    body = body_for("/v1/completions", {"model": "m", "prompt": "x"})
    assert body.generation(Settings().generation).max_new_tokens == GenerationSettings().max_new_tokens
    assert body.generation(GenerationSettings(max_new_tokens=7)).max_new_tokens == 7  # the process's, passed in


def test_the_memory_preflight_lives_in_workers():
    """The workers' memory check is workers/engine/preflight.py; the CLI only calls it."""
    from workers.engine import preflight

    assert callable(preflight.preflight_head) and callable(preflight.preflight_tail)
    for path in (ROOT / "producer").glob("*.py"):
        tree = ast.parse(path.read_text())
        defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert not {"preflight", "preflight_head", "same_device"} & defined, path


def test_engine_shapes_come_from_graph_k_never_from_a_request_k(models):
    shard = load_shard(models["qwen2"].target, (0, 2), embed=True, head=False)
    s = Settings(generation={"draft_k": 20}, engine={"graph_k": 3, "max_len": 64})
    assert Engine(shard, s).step_tokens == 4
    assert Engine(shard, Settings(engine={"max_len": 64})).step_tokens == EngineSettings().graph_k + 1
    runtime = HeadRuntime.load(models["qwen2"].target, (0, 2), draft=models["qwen2"].drafter, settings=s)
    assert runtime.engine.step_tokens == 4 and runtime.draft_model.engine.max_draft == 3  # type: ignore[union-attr]


def test_a_request_k_above_the_graph_size_runs_and_equals_generate(models, hf_models, tokenizers, redis_client):
    """A head and a tail made for k = 2 (graph_k) serve requests of k = 6: those rounds take the eager paths
    (whole-draft and round-step shapes too long for the engines' own), and stay lossless."""
    ms, tok, hf = models["qwen2"], tokenizers["qwen2"], hf_models["qwen2"]
    settings = Settings(engine={"graph_k": 2, "max_len": 128})
    names = Keys("graph-k-test")
    tail_shard = load_shard(ms.target, (2, ms.n_layers), embed=False, head=True)
    tail = TailWorker(tail_shard, redis_client, names=names, settings=settings)
    assert tail.engine.step_tokens == 3
    thread = threading.Thread(target=tail.serve, daemon=True)
    thread.start()
    try:
        wait_for_tails(redis_client, names)
        runtime = HeadRuntime.load(ms.target, (0, 2), draft=ms.drafter, settings=settings)
        for prompt in PROMPTS[:3]:
            ids = torch.tensor([tok.encode(prompt)])
            want = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20)
            draft = DraftSettings(kind="model", k=6, adaptive=False)
            req = GenerationRequest(prompt=prompt, max_new_tokens=20, chat_template=False, draft=draft)
            got = generate(req, runtime, redis_client, names=names)
            assert got.token_ids == want[0, ids.shape[1] :].tolist(), prompt
            assert got.drafted_tokens > 2 * got.rounds  # more drafts a round than the engines were made for
    finally:
        tail.stop_event.set()
        thread.join(30)


def test_a_workers_setup_applies_its_switch_interval(monkeypatch):
    """`torch_setup` (what `shardflow head` / `tail` run before loading) sets the interpreter's switch interval from
    engine.switch_interval_ms; None leaves Python's own."""
    import sys

    from producer.worker_options import torch_setup

    calls: list[float] = []
    monkeypatch.setattr(sys, "setswitchinterval", calls.append)  # this test process's own is left as it is
    torch_setup(Settings(engine={"switch_interval_ms": 2.0}))
    torch_setup(Settings(engine={"switch_interval_ms": None}))
    torch_setup(Settings())
    assert calls == [0.002, 0.001]
