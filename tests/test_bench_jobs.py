"""The job-path benchmark (bench/jobs.py) from outside, as tests see bench (never imported: `python -m`): its pure
computations (a round's accounting, phase lines of the worker logs, steady state and slot gaps, layer cuts) through
the examples in their docstrings, and one small run through three workers whose report has them all."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.job_env import spawn

ROOT = Path(__file__).resolve().parents[1]
PURE = ("jobs_waves", "jobs_accounting", "jobs_workers")


def test_bench_jobs_pure_computations_pass_their_examples(tmp_path):
    """The doctests of the bench's plain functions (steady state, slot gaps, round accounting, phase-line parsing,
    GPU busy per role, layer cuts), run by `python -m doctest` in a process of their own: tests never import bench."""
    log = tmp_path / "doctest.log"
    proc = spawn([sys.executable, "-m", "doctest", *(str(ROOT / "bench" / f"{m}.py") for m in PURE)], log)
    assert proc.wait(120) == 0, log.read_text()[-4000:]


@pytest.mark.slow
def test_bench_jobs_with_a_middle_stage_reports_rounds_waves_and_hops(tmp_path):
    """`python -m bench.jobs --tiny --stages 3`: a head, a middle stage and a tail (layers 0:1, 1:2, 2:4), three jobs
    one at a time (--concurrency 1: three waves). jobs.json has each round's parts summing to its wall time, a steady
    state, the slots' gaps and a hop list; jobs.md has the columns."""
    out = tmp_path / "out"
    args = [sys.executable, "-m", "bench.jobs", "--tiny", "--stages", "3", "--n", "3", "--new-tokens", "8"]
    args += ["--prompt-tokens", "8", "--link", "none", "--head-args", "--concurrency 1 --threads 1"]
    args += ["--tail-args", "--threads 1", "--stage-args", "--threads 1", "--out", str(out)]
    log = tmp_path / "bench.log"
    proc = spawn(args, log)
    try:
        code = proc.wait(240)
    finally:
        proc.terminate()
    assert code == 0, log.read_text()[-4000:]
    doc = json.loads((out / "jobs.json").read_text())
    assert doc["settings"]["stages"] == 3 and doc["settings"]["cuts"] == [1, 2]
    (row,) = doc["rows"]
    assert row["finished"] == 3 and not row["failed"]
    rounds = row["accounting"]["rounds"]
    parts = sum(rounds["parts_ms"].values()) + rounds["head_loop_wait_ms"]
    assert rounds["rounds"] >= 3 and abs(parts - rounds["round_ms"]) < 0.1, rounds
    assert rounds["hop_ms"] == [] or len(rounds["hop_ms"]) == 1  # one middle stage (once results carry hop_ms)
    assert set(row["accounting"]["phases"]) == {"head", "stage1", "tail"}
    assert row["accounting"]["gpu_busy"] == {"head": None, "stage1": None, "tail": None}
    gen = row["waves"]["generation"]
    assert gen["steady_state"]["tokens_per_s"] > 0 and gen["slot_empty"]["jobs"] >= 1, row["waves"]
    assert len(row["waves"]["spans"]) == 3 and (out / "logs" / "default-stage1.log").exists()
    md = (out / "jobs.md").read_text()
    assert "| steady-state tok/s |" in md and "| waiting for the head loop |" in md and "| hops |" in md
    assert "stage1: weights / caches / graphs / process" in md
