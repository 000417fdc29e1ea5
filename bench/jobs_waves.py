"""Waves of bench/jobs.py: a batch of more jobs than a head takes at once runs in waves, and these figures say whether
they drain (plain functions of each job's start, end and tokens; their examples are their tests, run by
tests/test_bench_jobs.py through `python -m doctest`). Not run on its own: see `python -m bench.jobs --help`.

- `steady_state`: tokens per second between the first wave's end (the first job's completion) and the last wave's
  start (the last job's start), each job's tokens spread evenly over its run interval and counted for the part of it
  inside that window; reported beside the whole batch's figure, never instead of it.
- `slot_gaps`: how long a slot stands empty: with `capacity` jobs in flight, the (capacity+k)-th job to start takes
  the slot the k-th to end freed; the gap between the two, for every job that started after another ended.

Each job is measured on its generation's own clock (`job_spans`): from its seat in a cache slot to its end (the
result's `timings.total_ms`), placed to end at RQ's `ended_at`, so that the few round trips between a generation's
end and RQ's record of it, about the same for every job, cancel out of the gaps. The steady state is also given on
RQ's clock (`started_at` -> `ended_at`: from the head's dispatcher taking the job, which may then wait for a cache
slot beside the step loop, to its records written); RQ's clock tells no slot gaps: the dispatcher takes the next job
as soon as a generation ends, before that job's `ended_at` is written.
"""

from __future__ import annotations

from collections.abc import Sequence

Span = tuple[float, float, int]  # (start, end, tokens): epoch seconds, or any one clock's seconds


def steady_state(spans: Sequence[Span]) -> dict | None:
    """Tokens per second from the first job's end to the last job's start (see the module docstring); None where
    that window is empty (every job started before the first ended: one wave) or there are fewer than two jobs.

    >>> steady_state([(0.0, 2.0, 20), (0.0, 3.0, 30), (2.0, 5.0, 30), (3.0, 6.0, 30)])  # 2..3 s: 10 + 10 tokens
    {'from_s': 2.0, 'to_s': 3.0, 'window_s': 1.0, 'tokens': 20.0, 'tokens_per_s': 20.0}
    >>> steady_state([(0, 2, 20), (0, 3, 30)]) is None  # one wave
    True
    """
    if len(spans) < 2:
        return None
    t_a, t_b = min(e for _, e, _ in spans), max(s for s, _, _ in spans)
    if t_b <= t_a:
        return None
    got = sum(n * max(0.0, min(e, t_b) - max(s, t_a)) / (e - s) for s, e, n in spans if e > s)
    window = t_b - t_a
    return {
        "from_s": round(t_a, 4),
        "to_s": round(t_b, 4),
        "window_s": round(window, 4),
        "tokens": round(got, 1),
        "tokens_per_s": round(got / window, 3),
    }


def slot_gaps(spans: Sequence[Span], capacity: int | None = None) -> dict | None:
    """How long a freed slot stood empty: for k = 1.., the (capacity+k)-th start minus the k-th end, in seconds
    (p50, max, and how many came out below zero, counted as 0: the next job was seated before the slot was freed,
    which a clock's estimate or a capacity larger than assumed allows). `capacity`: jobs in flight at once (None:
    those that started before the first ended). None where no job started after another ended.

    >>> slot_gaps([(0, 2, 1), (0, 3, 1), (2.5, 5, 1), (3.1, 6, 1)])  # 2.5 - 2, 3.1 - 3
    {'capacity': 2, 'jobs': 2, 'p50_s': 0.3, 'max_s': 0.5, 'below_zero': 0}
    >>> slot_gaps([(0, 2, 1), (1.9, 3, 1)], capacity=1)
    {'capacity': 1, 'jobs': 1, 'p50_s': 0.0, 'max_s': 0.0, 'below_zero': 1}
    >>> slot_gaps([(0, 2, 1), (0, 3, 1)]) is None
    True
    """
    if not spans:
        return None
    starts, ends = sorted(s for s, _, _ in spans), sorted(e for _, e, _ in spans)
    cap = sum(1 for s in starts if s < ends[0]) if capacity is None else capacity
    raw = [starts[cap + k] - ends[k] for k in range(len(starts) - cap)]
    if not raw:
        return None
    gaps = sorted(max(0.0, g) for g in raw)
    mid = len(gaps) // 2
    p50 = gaps[mid] if len(gaps) % 2 else (gaps[mid - 1] + gaps[mid]) / 2
    return {
        "capacity": cap,
        "jobs": len(raw),
        "p50_s": round(p50, 4),
        "max_s": round(gaps[-1], 4),
        "below_zero": sum(1 for g in raw if g < 0),
    }


def job_spans(jobs: Sequence[tuple[float | None, float | None, float | None, int]]) -> dict[str, list[Span]]:
    """Each finished job's span on both clocks from (RQ started_at, RQ ended_at, the result's total_ms, tokens):
    "generation" (ended_at - total_ms -> ended_at; RQ's start where total_ms is missing) and "rq" (started_at ->
    ended_at); a job without an end is left out.

    >>> job_spans([(10.0, 13.0, 2500.0, 8), (10.0, None, 100.0, 8)])
    {'generation': [(10.5, 13.0, 8)], 'rq': [(10.0, 13.0, 8)]}
    """
    out: dict[str, list[Span]] = {"generation": [], "rq": []}
    for start, end, total_ms, tokens in jobs:
        if end is None:
            continue
        if total_ms:
            out["generation"].append((end - total_ms / 1000, end, tokens))
        elif start is not None:
            out["generation"].append((start, end, tokens))
        if start is not None:
            out["rq"].append((start, end, tokens))
    return out


def waves(jobs: Sequence[tuple[float | None, float | None, float | None, int]], t0: float) -> dict:
    """A batch's steady state and slot gaps on the generation clock, its steady state on RQ's (`job_spans`), times
    relative to `t0` (the batch's enqueue), and each job's generation span (start, end, tokens) for the record."""
    spans = {clock: [(s - t0, e - t0, n) for s, e, n in x] for clock, x in job_spans(jobs).items()}
    gen = spans["generation"]
    return {
        "generation": {"steady_state": steady_state(gen), "slot_empty": slot_gaps(gen)},
        "rq": {"steady_state": steady_state(spans["rq"])},
        "spans": [(round(s, 4), round(e, 4), n) for s, e, n in gen],
    }


def brief(row: dict) -> tuple[str, str]:
    """(steady-state tok/s, "slot empty p50 / max ms (jobs)") of a report row, on the generation clock; "—" without.

    >>> brief({"waves": {"generation": {"steady_state": {"tokens_per_s": 12.5}, "slot_empty": None}}})
    ('12.50', '—')
    """
    gen = (row.get("waves") or {}).get("generation") or {}
    steady, gaps = gen.get("steady_state"), gen.get("slot_empty")
    s = "—" if not steady else f"{steady['tokens_per_s']:.2f}"
    g = "—" if not gaps else f"{1000 * gaps['p50_s']:.0f} / {1000 * gaps['max_s']:.0f} ({gaps['jobs']})"
    return s, g
