"""A worker loading half the layers of a multi-file checkpoint holds only those parameters."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from workers.engine.shard import load_shard, weight_files
from workers.tiny_models import save_tiny_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("mem") / "m", "qwen2", layers=8, hidden=768, max_shard_size="40MB")


def expected_params(model: Path, prefixes: tuple[str, ...]) -> int:
    total = 0
    for name, path in weight_files(model).items():
        if name.startswith(prefixes):
            with safe_open(str(path), framework="pt") as f:
                total += _numel(f.get_slice(name).get_shape())
    return total


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def test_shard_holds_only_its_layers(big_checkpoint):
    assert len(set(weight_files(big_checkpoint).values())) > 1
    head = load_shard(big_checkpoint, (0, 4), embed=True, head=False)
    names = {n for n, _ in head.named_parameters()}
    assert not any(n.startswith(("norm", "lm_head")) for n in names)
    want = expected_params(big_checkpoint, tuple(f"model.layers.{i}." for i in range(4)) + ("model.embed_tokens.",))
    assert sum(p.numel() for p in head.parameters()) == want
    tail = load_shard(big_checkpoint, (4, 8), embed=False, head=True)
    want = expected_params(
        big_checkpoint, tuple(f"model.layers.{i}." for i in range(4, 8)) + ("model.norm.", "lm_head.")
    )
    assert sum(p.numel() for p in tail.parameters()) == want
    assert [layer.self_attn.layer_idx for layer in tail.layers] == [4, 5, 6, 7]


def measure(model: Path, layers: str, *flags: str) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.memory",
            "--model",
            str(model),
            "--layers",
            layers,
            "--json",
            *flags,
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak-RSS reset")
def test_half_shard_peak_rss_near_half(big_checkpoint):
    half = measure(big_checkpoint, "0:4")
    full = measure(big_checkpoint, "0:8", "--head")
    ckpt = half["checkpoint_bytes"]
    assert abs(half["param_bytes"] - ckpt / 2) < 0.05 * ckpt
    assert half["rss_growth_bytes"] < 0.6 * ckpt + (16 << 20)
    assert full["rss_growth_bytes"] - half["rss_growth_bytes"] > 0.4 * ckpt
