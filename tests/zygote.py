"""A fork server for the suite's worker processes: one Python process that has imported the heavy third-party
libraries (torch, transformers, redis, rq, pydantic, starlette, ...) once, and forks a child per `python -m
MODULE ARGS` the fixtures start (tails, head workers, serve). A fresh `python -m producer tail` spends about 4 of
its 5 CPU seconds importing those; a forked one starts in a fraction of a second. The child is a real process of
its own (its own pid, Redis connections, signals, exit code) that runs MODULE's `__main__` exactly as `python -m`
does; none of the project's own modules are imported before the fork, so its settings (SHARDFLOW_* variables)
are read in the child as in a fresh process.

Run by tests/job_env.py (`spawn`): `python -m tests.zygote SOCKET STATUS_DIR`. Each request on the Unix socket is
one JSON line {"argv", "env", "cwd", "log"}; the answer is {"pid"}. The server reaps its children and writes
each one's return code (negative: the signal that ended it, as subprocess does) to STATUS_DIR/PID.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1
ROOT = Path(__file__).resolve().parents[1]
HEAVY = (  # third-party modules only: the project's are imported in each child, after its environment is set
    "torch",
    "numpy",
    "safetensors.torch",
    "transformers",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.llama.modeling_llama",
    "tokenizers",
    "redis",
    "rq",
    "rq.worker",
    "pydantic",
    "pydantic_settings",
    "click",
    "httpx",
    "starlette.applications",
    "uvicorn",
)


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _reap(status_dir: str) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        tmp = os.path.join(status_dir, f".{pid}")
        with open(tmp, "w") as f:
            f.write(str(code))
        os.replace(tmp, os.path.join(status_dir, str(pid)))


def _child(server: socket.socket, conn: socket.socket, req: dict) -> list[str]:
    """In the forked child: its own output, directory, environment and argv; returns the argv to run."""
    server.close()
    conn.close()
    _die_with_parent()
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    random.seed()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    out = os.open(req["log"] or os.devnull, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(null)
    os.close(out)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    return req["argv"]


def serve(path: str, status_dir: str) -> list[str]:
    """Answer fork requests until stdin closes (the test session ended); in a child, return its argv."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        ready, _, _ = select.select([server, sys.stdin], [], [], 0.05)
        _reap(status_dir)
        if sys.stdin in ready and not sys.stdin.buffer.read1(1):
            return []
        if server not in ready:
            continue
        conn, _ = server.accept()
        with conn:
            req = json.loads(conn.makefile("rb").readline())
            pid = os.fork()
            if pid == 0:
                return _child(server, conn, req)
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")


def main() -> None:
    _die_with_parent()
    for name in HEAVY:
        __import__(name)
    assert threading.active_count() == 1, "an import started a thread: forking would not be safe"
    argv = serve(sys.argv[1], sys.argv[2])
    if not argv:
        return
    sys.argv = list(argv)  # argv[0] (the module's name) becomes its file's path, as under `python -m`
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)


# --- the test session's side ----------------------------------------------------------------------------------
class Forked:
    """A forked child, as much of `subprocess.Popen` as the fixtures use (its parent is the fork server)."""

    def __init__(self, pid: int, args: list[str], status: Path) -> None:
        self.pid, self.args, self.status, self.returncode = pid, args, status, None

    def poll(self) -> int | None:
        if self.returncode is None and self.status.exists():
            self.returncode = int(self.status.read_text())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """A fork server started in `env` (tests/job_env.py starts them): `spawn` forks `python -m MODULE ...` from
    it when the child's environment differs from `env` only where `plain_env` looks away, else returns None (the
    caller starts a fresh process)."""

    def __init__(self, tmp: Path, env: dict[str, str]) -> None:
        self.sock, self.status = tmp / "zygote.sock", tmp / "status"
        self.status.mkdir()
        self.base = plain_env(env)
        args = [sys.executable, "-m", "tests.zygote", str(self.sock), str(self.status)]
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT, env=self.base)
        assert self.proc.stdout is not None and self.proc.stdout.readline() == b"ready\n", "fork server failed"

    def spawn(self, args: list[str], env: dict[str, str], log: Path | None) -> Forked | None:
        if self.proc.poll() is not None or args[:2] != [sys.executable, "-m"] or plain_env(env) != self.base:
            return None
        req = {"argv": args[2:], "env": env, "cwd": os.getcwd(), "log": str(log) if log else None}
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(str(self.sock))
                s.sendall(json.dumps(req).encode() + b"\n")
                pid = json.loads(s.makefile("rb").readline())["pid"]
        except (OSError, ValueError, KeyError):  # the server is gone: the caller starts a fresh process
            return None
        return Forked(pid, args, self.status / str(pid))

    def close(self) -> None:
        """Stop serving (its children get SIGTERM as it exits, as a dead parent's would)."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(30)
        shutil.rmtree(self.sock.parent, ignore_errors=True)


def plain_env(env: dict[str, str]) -> dict[str, str]:
    """The environment but for SHARDFLOW_* variables (read by the project's code, in the child) and pytest's
    PYTEST_CURRENT_TEST (a new value every test)."""
    return {k: v for k, v in env.items() if not k.startswith("SHARDFLOW_") and k != "PYTEST_CURRENT_TEST"}


if __name__ == "__main__":
    main()
