"""One configuration per command (producer/options.py `CliConfig`): a producer verb reads SHARDFLOW_* from the
environment once, applies its connection flags on top and hands that one `Settings` to what it builds."""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner

from producer.cli import main
from schemas.settings import Settings

QUEUE, PREFIX = f"cfgq-{os.getpid()}", f"cfgp-{os.getpid()}"


@pytest.fixture
def settings_built(monkeypatch) -> list[Settings]:
    """Every `Settings` built from the environment (its __init__ run) while the test runs."""
    built: list[Settings] = []
    init = Settings.__init__

    def counting(self, *args, **kwargs) -> None:
        built.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(Settings, "__init__", counting)
    return built


def test_enqueue_reads_settings_once(redis_server, settings_built):
    args = ["enqueue", "hi", "there", "--redis-url", redis_server.url, "--prefix", PREFIX, "--queue", QUEUE]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert len(settings_built) == 1


def test_enqueue_from_the_environment_reads_it_once(redis_server, settings_built, monkeypatch):
    """Every flag left to its setting's default (--redis-url, --retries, --max-new-tokens...): still one read."""
    monkeypatch.setenv("SHARDFLOW_REDIS__URL", redis_server.url)
    monkeypatch.setenv("SHARDFLOW_REDIS__PREFIX", PREFIX)
    monkeypatch.setenv("SHARDFLOW_JOBS__QUEUE", QUEUE)
    result = CliRunner().invoke(main, ["enqueue", "hi", "--json"])
    assert result.exit_code == 0, result.output
    assert len(settings_built) == 1
    assert f'"queue": "{QUEUE}"' in result.output


def test_flags_win_over_the_environment(monkeypatch):
    from producer.options import CliConfig

    monkeypatch.setenv("SHARDFLOW_JOBS__QUEUE", "from-env")
    monkeypatch.setenv("SHARDFLOW_REDIS__PREFIX", "env-prefix")
    config = CliConfig(redis={"url": "redis://example:1/0", "prefix": None}, jobs={"queue": "from-flag"})
    assert (config.redis_url, config.prefix, config.queue) == ("redis://example:1/0", "env-prefix", "from-flag")
    more = config.with_flags(engine={"slots": 3})
    assert more.settings.engine.slots == 3 and more.queue == "from-flag"
