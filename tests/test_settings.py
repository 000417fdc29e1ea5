"""The one Settings (schemas/settings.py): groups by concern, the environment's nested and flat names, flags on
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
from schemas.flat_env import flat_names
from schemas.keys import Keys
from schemas.requests import DraftSettings, GenerationRequest
from schemas.settings import EngineSettings, GenerationSettings, Settings
from tests.conftest import PROMPTS
from workers.engine.runner import Engine
from workers.engine.shard import load_shard
from workers.head.runtime import HeadRuntime, generate
from workers.tail.server import TailWorker

ROOT = Path(__file__).resolve().parents[1]

# Every flat name ShardFlow 0.1 read (SHARDFLOW_<NAME>): each still sets its field.
OLD_NAMES = """redis_url prefix socket_timeout_s connect_attempts reconnect_min_s reconnect_max_s worker_restart_max_s
worker_restart_reset_s block_ms queue result_ttl_s max_batch_jobs job_timeout_s job_retries retry_intervals_s
heartbeat_s heartbeat_ttl_s maintenance_s poll_interval_s follow_block_ms follow_read_count progress_interval_s
api_max_body_bytes api_max_concurrent api_timeout_s api_body_timeout_s api_max_json_depth api_liveness_s
api_result_grace_s api_shutdown_s api_model_name api_shared_batches draft_k ngram_max ngram_min batch_slots gpu_memory
cuda_context_gib graph_reserve max_slots short_cache_len long_slots_share cpu_slots batch_linger_ms static_cache_len
graph_capture_len verify_warp_rows head_groups prefill_tokens fused_layers max_new_tokens group_messages head_poll_ms
reply_timeout_s tail_busy_wait_s tail_busy_max_s resume_attempts max_packet_bytes max_header_bytes max_tensor_elements
request_stream_maxlen dead_letter_maxlen reply_stream_maxlen reply_read_count reply_dead_letters_max reply_ttl_s
final_reply_ttl_s claim_idle_ms tail_stream_ttl_s tail_keepalive_s max_sessions session_ttl_s head_check_s
head_recheck_s""".split()


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


def test_flat_names_of_0_1_still_work_below_nested_ones_and_flags_win(clean_env):
    clean_env.setenv("SHARDFLOW_REDIS_URL", "redis://flat:1/0")
    clean_env.setenv("SHARDFLOW_BATCH_SLOTS", "5")
    clean_env.setenv("SHARDFLOW_QUEUE", "q-flat")
    clean_env.setenv("SHARDFLOW_API_TIMEOUT_S", "9")
    clean_env.setenv("SHARDFLOW_GPU_MEMORY", "0.7")
    clean_env.setenv("SHARDFLOW_ENGINE__GPU_MEMORY", "0.3")  # the nested name wins over the flat one
    s = Settings()
    assert (s.redis.url, s.engine.slots, s.jobs.queue, s.api.timeout_s) == ("redis://flat:1/0", 5, "q-flat", 9.0)
    assert s.engine.gpu_memory == 0.3
    flags = options.worker_settings(engine={"slots": 2, "gpu_memory": None}, jobs={"queue": "q-flag"})
    assert (flags.engine.slots, flags.engine.gpu_memory, flags.jobs.queue) == (2, 0.3, "q-flag")  # None: not given


def test_every_old_flat_name_maps_to_one_field():
    flat = {name: (group, field) for group, field, name in flat_names(Settings)}
    assert len(flat) == len(list(flat_names(Settings))), "two fields answer to one flat name"
    assert not [n for n in OLD_NAMES if n not in flat]
    assert flat["redis_url"] == ("redis", "url") and flat["static_cache_len"] == ("engine", "max_len")


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

    from producer.options import torch_setup

    calls: list[float] = []
    monkeypatch.setattr(sys, "setswitchinterval", calls.append)  # this test process's own is left as it is
    torch_setup(Settings(engine={"switch_interval_ms": 2.0}))
    torch_setup(Settings(engine={"switch_interval_ms": None}))
    torch_setup(Settings())
    assert calls == [0.002, 0.001]
