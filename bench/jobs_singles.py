"""The N=1 row of `bench/jobs.py` over several prompts: single jobs run one after another, merged into one
row, so that "one job" is measured on the same prompts as the batches it is compared with (one prompt
alone can be far easier or harder to draft for than the mix: with n-gram drafts SmolLM2's first prompt
commits 7.1 tokens a round where the first eight average 5.5).

Each single job's row has distributions of one value, so pooling their p50s is exact.
"""

from __future__ import annotations

from bench.jobs_report import dist

DISTS = (
    "per_job_tokens_per_s", "latency_s", "latency_rq_s", "queue_wait_s", "run_s", "ttft_s", "ttft_text_s",
    "mean_accepted_per_round",
)  # fmt: skip


def merge_singles(rows: list[dict]) -> dict:
    """One report row for single-job rows run one at a time: tokens over the sum of their wall times."""
    if len(rows) == 1:
        return rows[0]
    out = dict(rows[-1])  # memory and other per-process fields: as after the last one
    tokens = sum(r["completion_tokens"] for r in rows)
    wall = sum(r["wall_s"] for r in rows)
    rounds = [r["completion_tokens"] / r["tokens_per_round"] if r.get("tokens_per_round") else 0.0 for r in rows]
    out.update(
        n=1,
        one_at_a_time=len(rows),
        n_label=f"1 (×{len(rows)} one at a time)",
        finished=sum(r["finished"] for r in rows),
        failed=[f for r in rows for f in r["failed"]],
        completion_tokens=tokens,
        wall_s=round(wall, 4),
        aggregate_tokens_per_s=round(tokens / wall, 3) if wall > 0 else None,
        tokens_per_round=round(tokens / sum(rounds), 3) if sum(rounds) else None,
        replays=sum(r["replays"] for r in rows),
        resumed_tokens=sum(r["resumed_tokens"] for r in rows),
        checked=sum(r["checked"] for r in rows),
        mismatches=None if rows[0]["mismatches"] is None else sum(r["mismatches"] for r in rows),
        ties=sum(r.get("ties", 0) for r in rows),
        tie_ulps_max=max((r["tie_ulps_max"] for r in rows if r.get("tie_ulps_max") is not None), default=None),
        mismatch_detail=[d for r in rows for d in r.get("mismatch_detail", [])][:20],
        waves=None,  # one job at a time: no waves
    )
    for key in DISTS:
        out[key] = dist([r[key]["p50"] for r in rows if r[key]["p50"] is not None])
    for key in ("rounds_batched_per_forward", "stage_ms_per_round"):
        out[key] = {
            k: round(sum(r[key][k] * n for r, n in zip(rows, rounds, strict=True)) / sum(rounds), 2)
            if sum(rounds) and all(r[key][k] is not None for r in rows)
            else None
            for k in rows[0][key]
        }
    return out
