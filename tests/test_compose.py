"""compose.yaml and deploy/compose.tls.yaml as each host of README "Three hosts with compose and TLS" uses
them: a directory holding the two files, deploy/ and a `.env` with ONLY that host's variables, parsed by
Debian's docker-compose 1.29 (`config` needs no Docker engine; it also rejects Compose v2-only syntax such
as ${VAR:+...}). For every host, plain and with the TLS overlay: the file renders, the host's services
are there, every URL names its role's user, REDIS_HOST and the port, no password is on a command line or
in a healthcheck, and the worker containers' command + environment is what `shardflow tail|head` accepts.

Needs `docker-compose` (scripts/test.sh installs Debian's as root); without it these tests skip, which
fails the suite under SHARDFLOW_STRICT_TESTS=1.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import click
import pytest
import yaml

from producer.cli import main

ROOT = Path(__file__).resolve().parent.parent
TLS = ("-f", "compose.yaml", "-f", "deploy/compose.tls.yaml")
PLAIN = ("-f", "compose.yaml")
PASSWORDS = {role: f"{role}-secret-{role[:2] * 10}" for role in ("admin", "producer", "head", "tail")}
PW_VARS = {f"REDIS_{role.upper()}_PASSWORD": pw for role, pw in PASSWORDS.items()}
MODEL = {"SHARDFLOW_TARGET": "Qwen/Qwen2.5-7B-Instruct"}

# Each host's .env, as README lists it; `services` are what that host starts.
HOSTS: dict[str, tuple[dict[str, str], tuple[str, ...]]] = {
    "one host": (
        PW_VARS
        | MODEL
        | {
            "SHARDFLOW_DRAFT": "Qwen/Qwen2.5-0.5B-Instruct",
            "SHARDFLOW_HEAD_LAYERS": "0:14",
            "SHARDFLOW_TAIL_LAYERS": "14:28",
        },
        ("redis", "tail", "head", "producer"),
    ),
    "redis vm": (PW_VARS, ("redis",)),
    "gpu a (tail)": (
        {"REDIS_TAIL_PASSWORD": PASSWORDS["tail"], "REDIS_HOST": "redis-vm.example", "SHARDFLOW_TAIL_LAYERS": "14:28"}
        | MODEL,
        ("tail",),
    ),
    "gpu b (head)": (
        {
            "REDIS_HEAD_PASSWORD": PASSWORDS["head"],
            "REDIS_HOST": "redis-vm.example",
            "SHARDFLOW_HEAD_LAYERS": "0:14",
            "SHARDFLOW_DRAFT": "Qwen/Qwen2.5-0.5B-Instruct",
        }
        | MODEL,
        ("head",),
    ),
    "gpu b (head, no draft)": (
        {"REDIS_HEAD_PASSWORD": PASSWORDS["head"], "REDIS_HOST": "10.0.0.5", "SHARDFLOW_HEAD_LAYERS": "0:14"} | MODEL,
        ("head",),
    ),
    "producer": ({"REDIS_PRODUCER_PASSWORD": PASSWORDS["producer"], "REDIS_HOST": "redis-vm.example"}, ("producer",)),
    "other ports": (PW_VARS | {"REDIS_PORT": "6390", "REDIS_TLS_PORT": "6391"}, ("redis",)),
    "empty .env": ({}, ()),
}
# What the compose environment must not take from the test process (a shell's variables beat .env).
LEAKY = re.compile(r"^(REDIS_|SHARDFLOW_|HF_|COMPOSE_|DOCKER_)")


def docker_compose() -> str:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("no docker-compose (apt-get install docker-compose; scripts/test.sh does as root)")
    return exe


def host_dir(tmp_path: Path, env: dict[str, str]) -> Path:
    """A checkout as a host holds it: compose.yaml, deploy/, and a .env with only this host's variables."""
    shutil.copy(ROOT / "compose.yaml", tmp_path / "compose.yaml")
    shutil.copytree(ROOT / "deploy", tmp_path / "deploy", ignore=shutil.ignore_patterns("users.acl", "__pycache__"))
    (tmp_path / ".env").write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    return tmp_path


def compose(workdir: Path, *args: str) -> str:
    environ = {k: v for k, v in os.environ.items() if not LEAKY.match(k)}
    proc = subprocess.run(
        [docker_compose(), *args], cwd=workdir, env=environ, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"docker-compose {' '.join(args)} failed:\n{proc.stderr}"
    return proc.stdout


def secrets_on_command_lines(service: dict[str, Any]) -> list[str]:
    """Every string of the service's command, entrypoint and healthcheck test (what `ps` and `inspect` show)."""
    out: list[str] = []
    for part in (service.get("command"), service.get("entrypoint"), (service.get("healthcheck") or {}).get("test")):
        if isinstance(part, str):
            out.append(part)
        elif part:
            out.extend(str(x) for x in part)
    return out


def published(service: dict[str, Any]) -> set[str]:
    """'published:target' of each port, in both the short and the long rendering."""
    ports = set()
    for p in service.get("ports", []):
        ports.add(p if isinstance(p, str) else f"{p['published']}:{p['target']}")
    return ports


def check_worker_cli(name: str, service: dict[str, Any], env: dict[str, str], monkeypatch) -> dict[str, Any]:
    """The container's command, with its rendered environment, parses as `shardflow <name>` (no model is loaded)."""
    command = service["command"]
    assert isinstance(command, list) and command[0] == name
    for key, value in service["environment"].items():
        monkeypatch.setenv(key, value or "")
    layers = f"SHARDFLOW_{name.upper()}_LAYERS"
    if not env.get("SHARDFLOW_TARGET") or not env.get(layers):  # the CLI's own error, when the worker starts
        with pytest.raises(click.MissingParameter) as missing:
            main.commands[name].make_context(name, list(command[1:]))
        assert f"env var: '{'SHARDFLOW_TARGET' if not env.get('SHARDFLOW_TARGET') else layers}'" in str(
            missing.value.format_message()
        )
        return {}
    return main.commands[name].make_context(name, list(command[1:])).params


@pytest.mark.parametrize("overlay", ["plain", "tls"])
@pytest.mark.parametrize("host", list(HOSTS))
def test_compose_config_per_host(tmp_path, monkeypatch, host: str, overlay: str):
    env, runs = HOSTS[host]
    workdir = host_dir(tmp_path, env)
    files = TLS if overlay == "tls" else PLAIN
    services = set(compose(workdir, *files, "config", "--services").split())
    assert services >= {"acl", "redis", "tail", "head", "producer"} and set(runs) <= services
    rendered = yaml.safe_load(compose(workdir, *files, "config"))["services"]

    redis_host = env.get("REDIS_HOST", "redis")
    port = env.get("REDIS_TLS_PORT", "6380") if overlay == "tls" else env.get("REDIS_PORT", "6379")
    scheme = "rediss" if overlay == "tls" else "redis"
    for role in ("tail", "head", "producer"):
        url = rendered[role]["environment"]["SHARDFLOW_REDIS__URL"]
        expected = f"{scheme}://{role}:{env.get(f'REDIS_{role.upper()}_PASSWORD', '')}@{redis_host}:{port}/0"
        if overlay == "tls":
            assert url.startswith(f"{expected}?")
            assert all(f"{opt}=/tls/" in url for opt in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"))
        else:
            assert url == expected
    for name, service in rendered.items():
        lines = " ".join(secrets_on_command_lines(service))
        assert not any(pw in lines for pw in PASSWORDS.values()), f"{name}: a password on a command line: {lines}"
        assert "--pass" not in lines and " -a " not in lines and "-u redis" not in lines

    redis = rendered["redis"]
    cmd = [str(x) for x in redis["command"]]
    health = " ".join(secrets_on_command_lines({"healthcheck": redis["healthcheck"]}))
    assert redis["environment"]["REDISCLI_AUTH"] == env.get("REDIS_ADMIN_PASSWORD", "")
    assert "--user admin" in health and f"-p {port}" in health and "PONG" in health
    assert cmd[cmd.index("--aclfile") + 1] == "/acl/users.acl"
    if overlay == "tls":
        assert cmd[cmd.index("--port") + 1] == "0" and cmd[cmd.index("--tls-port") + 1] == port
        assert cmd[cmd.index("--tls-auth-clients") + 1] == "yes" and "--tls" in health.split()
    else:
        assert cmd[cmd.index("--port") + 1] == port
    assert f"{port}:{port}" in published(redis)
    assert {k: v for k, v in rendered["acl"]["environment"].items() if k in PW_VARS} == {
        k: env.get(k, "") for k in PW_VARS
    }

    for name in ("tail", "head"):
        worker = rendered[name]
        assert "hf-cache:/home/shardflow/.cache/huggingface" in " ".join(str(v) for v in worker["volumes"])
        assert worker["environment"]["SHARDFLOW_TARGET"] == env.get("SHARDFLOW_TARGET", "")
        params = check_worker_cli(name, worker, env, monkeypatch)
        if params:
            assert params["target"] == env["SHARDFLOW_TARGET"] and params["device"] == "cuda:0"
            assert params["layers"] == tuple(int(x) for x in env[f"SHARDFLOW_{name.upper()}_LAYERS"].split(":"))
            if name == "head":
                assert params["draft"] == (env.get("SHARDFLOW_DRAFT") or None)
    assert "SHARDFLOW_TAIL_LAYERS" not in rendered["head"]["environment"]
    assert "SHARDFLOW_HEAD_LAYERS" not in rendered["tail"]["environment"]


def test_example_env_is_a_one_host_env(tmp_path):
    text = (ROOT / "deploy" / "example.env").read_text()
    for var, pw in PW_VARS.items():
        text = re.sub(rf"^{var}=$", f"{var}={pw}", text, flags=re.M)
    workdir = host_dir(tmp_path, {})
    (workdir / ".env").write_text(text)
    rendered = yaml.safe_load(compose(workdir, *TLS, "config"))["services"]
    assert rendered["tail"]["environment"]["SHARDFLOW_REDIS__URL"].startswith(
        f"rediss://tail:{PASSWORDS['tail']}@redis:"
    )
    assert rendered["head"]["environment"]["SHARDFLOW_HEAD_LAYERS"] == "0:14"
    assert rendered["redis"]["environment"]["REDISCLI_AUTH"] == PASSWORDS["admin"]


def test_compose_files_avoid_what_breaks_per_host_or_on_compose_1_29():
    for path in (ROOT / "compose.yaml", ROOT / "deploy" / "compose.tls.yaml"):
        text = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#"))
        # ${VAR:?...} fails `config` on every host (all services are interpolated), ${VAR:+...} on 1.29.
        assert not re.search(r"\$\{[A-Za-z_0-9]+:?[?+]", text), path


def test_the_image_gives_its_user_a_writable_model_cache():
    dockerfile = (ROOT / "Dockerfile").read_text()
    cache = "/home/shardflow/.cache/huggingface"
    steps = dockerfile.split("\nUSER shardflow")[0]  # created before the image drops root
    assert re.search(rf"install -d -o shardflow -g shardflow .*{re.escape(cache)}", steps)
    assert f"HF_HOME={cache}" in dockerfile
    base = yaml.safe_load((ROOT / "compose.yaml").read_text())
    for name in ("tail", "head"):
        assert f"hf-cache:{cache}" in base["services"][name]["volumes"]
