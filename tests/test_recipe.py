"""README "Two free notebooks" run as written, here: every bash block of that section, on CPU with tiny models.

- the Redis VM's block makes the passwords (in a copy of deploy/example.env) and the TLS certificates with
  the README's own openssl lines; Redis 7 then runs with those certificates and the ACL file rendered from
  that .env, as compose's `acl` and `redis` services do (tests/test_compose.py checks the compose files);
- the plan block's `shardflow plan` commands run on the real models' configs (no weights) and print
  exactly the README's plan text, and every worker command's --layers is the split that plan prints;
- the tail and head notebooks' blocks start real worker processes, and the laptop's block enqueues,
  follows and writes the results over TLS as the producer user; the Qwen2.5-14B 4-bit variant's workers
  start and announce their model too.

Only these change: a hub model id runs as a tiny local model (its config, for `plan`), a CUDA device as
the CPU, `--layers` keeps its side of the split on the tiny model, and the machine-specific values a user
fills in (REDIS_HOST, REDIS_TLS_PORT, TLS, passwords) are this test's. Lines that install or fetch (`git
clone`, `pip install`) or need Docker (`docker compose`) are skipped; nothing else is. Needs redis-server 7
with TLS and the openssl CLI, as tests/test_security.py; marked slow (about a minute and a half).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from transformers import Qwen2Config

from relay_broker.connection import connect
from relay_broker.embedded import free_port, tls_redis_server
from schemas.errors import TransportError
from tests.secure_redis import render_acl
from workers.tiny_models import build_tokenizer, save_noisy_copy, save_tiny_model

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SECTION = "### Two free notebooks"
SKIPPED = ("git clone ", "pip install ", "docker compose ")  # fetch, install, or need Docker
TINY_LAYERS, TINY_SPLIT = 4, 2
# The configs' shapes of the hub models the recipe names (their config.json: what `plan` reads).
CONFIGS = {
    "Qwen/Qwen2.5-7B-Instruct": dict(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    ),
    "Qwen/Qwen2.5-14B-Instruct": dict(
        vocab_size=152064,
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=48,
        num_attention_heads=40,
        num_key_value_heads=8,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    ),
    "Qwen/Qwen2.5-0.5B-Instruct": dict(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
    ),
}
DRAFT = "Qwen/Qwen2.5-0.5B-Instruct"

# This shim stands in for the `shardflow` command in every block: it maps the arguments, then runs the CLI.
SHIM = """
import json, os, sys
m = json.loads(os.environ["RECIPE_MAP"])
args, out = sys.argv[1:], []
verb = args[0] if args else ""
for i, a in enumerate(args):
    prev = args[i - 1] if i else ""
    if prev in ("--target", "--draft"):
        a = m["plan" if verb == "plan" else "run"][a]
    elif prev == "--layers":
        a = m["head_layers"] if a.startswith("0:") else m["tail_layers"]
    elif prev in ("--device", "--draft-device"):
        a = "cpu"
    out.append(a)
if verb in ("tail", "head"):
    out += ["--threads", "1"]
os.execv(sys.executable, [sys.executable, "-m", "producer", *out])
"""


@dataclass
class Block:
    lang: str
    title: str  # a bash block's first comment line, e.g. "tail notebook: Qwen2.5-7B, float16"
    text: str


def section_blocks() -> list[Block]:
    readme = (ROOT / "README.md").read_text()
    start = readme.index(SECTION)
    end = min(i for i in (readme.find("\n## ", start), readme.find("\n### ", start + 1)) if i > 0)
    out = []
    for lang, body in re.findall(r"```(\w+)\n(.*?)```", readme[start:end], flags=re.S):
        first = body.splitlines()[0]
        out.append(Block(lang, first.removeprefix("# ").strip() if first.startswith("# ") else "", body))
    return out


def bash_blocks(prefix: str) -> list[Block]:
    return [b for b in section_blocks() if b.lang == "bash" and b.title.startswith(prefix)]


def commands(block: Block) -> list[str]:
    """The block's logical lines (continuations joined), comments and blank lines dropped."""
    lines = block.text.replace("\\\n", " ").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def script(blocks: list[Block], overrides: dict[str, str]) -> str:
    """The blocks as one bash script: installs skipped, and after each `export` line the values the user
    would fill in for this machine (REDIS_HOST, REDIS_TLS_PORT, TLS, passwords) set to this test's."""
    out = ["set -euo pipefail", 'shardflow() { "$RECIPE_PYTHON" "$RECIPE_SHIM" "$@"; }']
    for block in blocks:
        for line in commands(block):
            if line.startswith(SKIPPED):
                continue
            out.append(line)
            if line.startswith("export "):
                names = [w.split("=", 1)[0] for w in shlex.split(line)[1:]]
                out += [f"export {n}={shlex.quote(overrides[n])}" for n in names if n in overrides]
    return "\n".join(out) + "\n"


@dataclass
class Recipe:
    tmp: Path
    env: dict[str, str]  # for the blocks: the shim, its model map, and Python
    overrides: dict[str, str]
    admin_url: str = ""

    def run(self, blocks: list[Block], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", "-c", script(blocks, self.overrides)],
            cwd=cwd,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def start(self, blocks: list[Block], log: Path) -> subprocess.Popen:
        with log.open("ab") as f:
            return subprocess.Popen(
                ["bash", "-c", script(blocks, self.overrides)],
                cwd=self.tmp,
                env=self.env,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its process group: bash and the worker it runs
            )


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def models(root: Path) -> dict[str, dict[str, str]]:
    """Hub id -> a directory with its config (for plan), and -> a tiny model (for the workers)."""
    plan = {}
    for hub_id, shape in CONFIGS.items():
        d = root / "configs" / hub_id.replace("/", "--")
        Qwen2Config(**shape, rms_norm_eps=1e-6, rope_theta=1e6, eos_token_id=151645).save_pretrained(d)
        plan[hub_id] = str(d)
    tok = build_tokenizer()
    target = save_tiny_model(root / "tiny", "qwen2", tokenizer=tok)
    draft = save_noisy_copy(target, root / "tiny-draft", 0.02)
    run = {hub_id: str(target) for hub_id in CONFIGS} | {DRAFT: str(draft)}
    return {"plan": plan, "run": run}


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Iterator[Recipe]:
    """The Redis VM's block run in a copy of the checkout's deploy/, then its Redis started."""
    binary = tls_redis_server()
    if binary is None or shutil.which("openssl") is None:
        pytest.skip("needs redis-server 7 with TLS and the openssl CLI (scripts/test.sh installs them as root)")
    tmp = tmp_path_factory.mktemp("recipe")
    checkout = tmp / "shardflow"
    shutil.copytree(ROOT / "deploy", checkout / "deploy")
    shim = tmp / "shim.py"
    shim.write_text(SHIM)
    layers = {"head_layers": f"0:{TINY_SPLIT}", "tail_layers": f"{TINY_SPLIT}:{TINY_LAYERS}"}
    env = {**os.environ, "RECIPE_PYTHON": sys.executable, "RECIPE_SHIM": str(shim)}
    env["RECIPE_MAP"] = json.dumps(models(tmp) | layers)
    env["PYTHONPATH"] = str(ROOT)
    overrides = {"REDIS_HOST": "localhost", "TLS": str(checkout / "tls")}
    vm = Recipe(tmp, env, overrides)
    done = vm.run(bash_blocks("Redis VM"), cwd=checkout, timeout=120)
    assert done.returncode == 0, done.stderr
    dotenv = render_acl.read_env_file(checkout / ".env")
    passwords = {k: v for k, v in dotenv.items() if k.endswith("_PASSWORD")}
    assert len(passwords) == 4 and all(len(v) == 48 for v in passwords.values()), "the .env lacks the passwords"
    acl = tmp / "users.acl"
    assert render_acl.main(["--env-file", str(checkout / ".env"), "-o", str(acl)]) == 0  # compose's `acl` service
    port = free_port()
    server = start_redis(binary, checkout / "tls", acl, port, tmp / "redis.log")
    try:
        overrides |= {"REDIS_TLS_PORT": str(port), **passwords}
        env |= passwords  # the notebooks' secrets
        tls = checkout / "tls"
        q = f"ssl_ca_certs={tls}/ca.crt&ssl_certfile={tls}/client.crt&ssl_keyfile={tls}/client.key"
        admin_url = f"rediss://admin:{passwords['REDIS_ADMIN_PASSWORD']}@localhost:{port}/0?{q}"
        wait_for_redis(admin_url, server, tmp / "redis.log")
        yield Recipe(tmp, env, overrides, admin_url)
    finally:
        stop(server)


def start_redis(binary: str, tls: Path, acl: Path, port: int, log: Path) -> subprocess.Popen:
    """redis-server as compose runs it with the TLS overlay: TLS only, client certificates, the ACL file."""
    args = [binary, "--bind", "127.0.0.1", "--port", "0", "--tls-port", str(port), "--aclfile", str(acl)]
    args += ["--tls-cert-file", str(tls / "redis.crt"), "--tls-key-file", str(tls / "redis.key")]
    args += ["--tls-ca-cert-file", str(tls / "ca.crt"), "--tls-auth-clients", "yes"]
    args += ["--save", "", "--appendonly", "no", "--dir", str(log.parent)]
    with log.open("ab") as f:
        return subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for_redis(url: str, server: subprocess.Popen, log: Path) -> None:
    """Until it answers PING over TLS at `localhost`, the name the server certificate holds."""
    deadline = time.monotonic() + 30
    while True:
        assert server.poll() is None, log.read_text()[-2000:]
        try:
            if connect(url, attempts=1, socket_connect_timeout=2).ping():
                return
        except TransportError:
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.1)


def _plan_rows(text: str) -> dict[str, dict[str, str]]:
    """target -> worker -> layers, from `shardflow plan`'s text."""
    out: dict[str, dict[str, str]] = {}
    target = ""
    for line in text.splitlines():
        if ": " in line and not line.startswith(("worker", "head", "tail", "draft")):
            target = line.split(": ", 1)[0]
        elif line.split() and line.split()[0] in ("head", "tail", "draft"):
            out.setdefault(target, {})[line.split()[0]] = line.split()[2]
    return out


def test_the_plan_block_prints_the_readmes_plan_and_the_workers_use_its_split(recipe):
    blocks = section_blocks()
    plan_block = bash_blocks("any machine")
    assert len(plan_block) == 1
    text_block = blocks[blocks.index(plan_block[0]) + 1]
    assert text_block.lang == "text"
    done = recipe.run(plan_block, cwd=recipe.tmp)
    assert done.returncode == 0, done.stderr
    printed = done.stdout
    for hub_id, d in json.loads(recipe.env["RECIPE_MAP"])["plan"].items():
        printed = printed.replace(d, hub_id)
    assert printed == text_block.text
    splits = _plan_rows(printed)
    assert set(splits) == {"Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-14B-Instruct"}
    workers = [c for b in section_blocks() if b.lang == "bash" for c in commands(b)]
    workers = [shlex.split(c) for c in workers if c.startswith(("shardflow tail ", "shardflow head "))]
    assert len(workers) == 4
    for argv in workers:
        target, layers = argv[argv.index("--target") + 1], argv[argv.index("--layers") + 1]
        assert layers == splits[target][argv[1]], (argv[1], target)


def _wait_for_head(recipe: Recipe, procs: list[subprocess.Popen], logs: list[Path]) -> None:
    admin = connect(recipe.admin_url, attempts=1)
    deadline = time.monotonic() + 120
    while not (admin.exists("shardflow:model:shardflow") and admin.scard("rq:workers:shardflow")):
        for p, log in zip(procs, logs, strict=True):
            assert p.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, [log.read_text()[-2000:] for log in logs]
        time.sleep(0.3)


def _workers(recipe: Recipe, variant: str, name: str) -> tuple[list[subprocess.Popen], list[Path]]:
    """The tail's and the head's notebook blocks of one variant (the first blocks of each notebook set
    the connection; a later variant's block runs after them, on the same notebook)."""
    procs, logs = [], []
    for machine in ("tail notebook", "head notebook"):
        blocks = bash_blocks(machine)
        chosen = [b for b in blocks if variant in b.title]
        assert len(chosen) == 1, [b.title for b in blocks]
        setup = [blocks[0]] if chosen[0] is not blocks[0] else []
        if setup:  # run only the first block's exports, not its worker
            setup = [Block("bash", "", "\n".join(c for c in commands(blocks[0]) if c.startswith("export ")))]
        log = recipe.tmp / f"{name}-{machine.split()[0]}.log"
        procs.append(recipe.start([*setup, chosen[0]], log))
        logs.append(log)
    return procs, logs


def test_the_notebooks_and_the_laptop_run_a_batch_over_tls_as_their_own_users(recipe):
    procs, logs = _workers(recipe, "Qwen2.5-7B, float16", "7b")
    try:
        _wait_for_head(recipe, procs, logs)
        laptop = recipe.tmp / "laptop"
        laptop.mkdir()
        done = recipe.run(bash_blocks("laptop"), cwd=laptop)
        assert done.returncode == 0, (done.stdout, done.stderr, [log.read_text()[-2000:] for log in logs])
    finally:
        for p in procs:
            stop(p)
    assert "[0] " in done.stdout and "[1] " in done.stdout  # results --follow
    results = [json.loads(line) for line in (laptop / "results.jsonl").read_text().splitlines()]
    assert [r["status"] for r in results] == ["finished", "finished"], results
    assert all(r["result"]["text"] and r["result"]["token_ids"] for r in results)
    denied = connect(recipe.admin_url, attempts=1).acl_log()
    assert [e for e in denied if e.get("reason") != "auth"] == [], "a role was refused what the recipe needs"


def test_the_14b_4bit_variant_starts_and_announces_its_model(recipe):
    """Its tail and head (4-bit shards, the drafter on its own device) load and the head announces the model."""
    admin = connect(recipe.admin_url, attempts=1)
    admin.delete("shardflow:model:shardflow")
    procs, logs = _workers(recipe, "Qwen2.5-14B, 4-bit", "14b")
    try:
        _wait_for_head(recipe, procs, logs)
        info = json.loads(admin.get("shardflow:model:shardflow"))
        assert info["head_layers"] == [0, TINY_SPLIT] and info["draft"], info
    finally:
        for p in procs:
            stop(p)
