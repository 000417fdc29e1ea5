"""Where a round of bench/jobs.py goes, per N: the mean ms per round of each part the head times (the results'
`RoundTimings`), the rest of a round's wall time, the worker loops' busy shares from their phase lines in the worker
logs (workers/phases.py `PhaseClock`), and GPU busy per role (bench/usage.py). Plain functions; their examples are
their tests (run by tests/test_bench_jobs.py through `python -m doctest`). Not run on its own: see
`python -m bench.jobs --help`.

A round's wall time is a job's run time over its rounds: the generation's own clock, from its seat in a cache slot
to its end (`total_ms`), summed over the batch's jobs and divided by their rounds. Its parts, which do not overlap:
the draft, the head's forward, the relay (the link both ways, Redis, the head's I/O threads; of which the send, the
tail's preparation and the way back, and each middle stage's hop, `hop_ms`, are parts), the round's wait in the
tail's stream, the tail's forward and its verification. What is left is "waiting for the head loop": the round's
generation ready, but not in the group the loop was computing (another group's draft and forward, the loop's own
host work, a reply not yet taken).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.usage import gpu_indices

PARTS = ("draft_ms", "head_forward_ms", "relay_ms", "tail_queue_ms", "tail_forward_ms", "verify_ms")  # disjoint
RELAY_PARTS = ("send_ms", "tail_prepare_ms", "back_ms")  # within relay_ms


def round_accounting(results: Sequence[dict]) -> dict | None:
    """Mean ms per round of each part (`PARTS`, `RELAY_PARTS`, each middle stage's `hop_ms`) over the finished
    jobs' results, the round's wall time, and the rest ("head_loop_wait_ms"); None without rounds.

    >>> t = {"draft_ms": 10, "head_forward_ms": 20, "relay_ms": 100, "send_ms": 30, "tail_queue_ms": 4,
    ...      "tail_forward_ms": 20, "verify_ms": 2, "total_ms": 200, "hop_ms": [40.0]}
    >>> a = round_accounting([{"rounds": 2, "timings": t}, {"rounds": 2, "timings": t | {"hop_ms": [20.0]}}])
    >>> a["round_ms"], a["parts_ms"]["relay_ms"], a["relay_parts_ms"]["send_ms"], a["head_loop_wait_ms"], a["hop_ms"]
    (100.0, 50.0, 15.0, 22.0, [15.0])
    >>> round_accounting([{"rounds": 0, "timings": {}}]) is None
    True
    """
    rounds = sum(int(x.get("rounds", 0)) for x in results)
    if not rounds:
        return None

    def per_round(key: str) -> float:
        return sum(float(x.get("timings", {}).get(key, 0.0)) for x in results) / rounds

    parts = {k: round(per_round(k), 2) for k in PARTS}
    wall = per_round("total_ms")
    hops: list[float] = []
    for x in results:  # index i: the i-th middle stage (a job through fewer adds nothing there)
        for i, ms in enumerate(x.get("timings", {}).get("hop_ms", []) or []):
            hops += [0.0] * (i + 1 - len(hops))
            hops[i] += float(ms)
    return {
        "rounds": rounds,
        "jobs": len(results),
        "round_ms": round(wall, 2),
        "parts_ms": parts,
        "relay_parts_ms": {k: round(per_round(k), 2) for k in RELAY_PARTS},
        "hop_ms": [round(h / rounds, 2) for h in hops],
        "head_loop_wait_ms": round(wall - sum(per_round(k) for k in PARTS), 2),
    }


# "2025-01-02 03:04:05,678 INFO shardflow.head: head loop: 10.0 s: compute 61% (4.1 ms x 150), dead letters 3"
# (producer/cli.py's log format; workers/phases.py's message)
PHASE_LINE = re.compile(
    r"^(?P<at>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(?P<ms>\d{3}) \S+ \S+: (?P<clock>[a-z][a-z ]*[a-z]): "
    r"(?P<span>\d+(?:\.\d+)?) s: (?P<parts>.+)$"
)
PHASE = re.compile(r"^(?P<name>.+?) (?P<pct>\d+)% \((?P<ms>\d+(?:\.\d+)?) ms x (?P<calls>\d+)\)$")
COUNT = re.compile(r"^(?P<name>.+?) (?P<n>\d[\d,]*)$")


@dataclass(frozen=True)
class PhaseLine:
    """One logged line of a PhaseClock: the span it covers (ending at `end`, epoch seconds), seconds and calls per
    phase, and the events counted."""

    clock: str
    end: float
    span_s: float
    spent: dict[str, float]
    calls: dict[str, int]
    counts: dict[str, int]


def parse_phase_line(line: str) -> PhaseLine | None:
    """A PhaseClock line of a worker log, or None for any other line. A phase's seconds come from its ms x calls or
    from its share of the span, whichever the rounding of the line leaves more exact.

    >>> p = parse_phase_line("2025-01-02 03:04:05,500 INFO shardflow.head: head loop: 10.0 s: "
    ...                      "compute 61% (40.7 ms x 150), wait 30% (0.0 ms x 90000), dead letters 1,234")
    >>> p.clock, p.span_s, p.spent, p.calls["wait"], p.counts
    ('head loop', 10.0, {'compute': 6.105, 'wait': 3.0}, 90000, {'dead letters': 1234})
    >>> p.end - time.mktime(time.strptime("2025-01-02 03:04:05", "%Y-%m-%d %H:%M:%S"))
    0.5
    >>> parse_phase_line("2025-01-02 03:04:05,500 INFO shardflow.dispatcher: job x finished in 1.00s") is None
    True
    """
    m = PHASE_LINE.match(line.rstrip("\n"))
    if m is None:
        return None
    span = float(m["span"])
    spent: dict[str, float] = {}
    calls: dict[str, int] = {}
    counts: dict[str, int] = {}
    for part in m["parts"].split(", "):
        if p := PHASE.match(part):
            n, ms, pct = int(p["calls"]), float(p["ms"]), float(p["pct"])
            # rounding: ms to 0.05 ms per call, the share to half a percent of the span
            spent[p["name"]] = round(ms * n / 1000 if 0.05e-3 * n < 0.005 * span else pct * span / 100, 6)
            calls[p["name"]] = n
        elif c := COUNT.match(part):
            counts[c["name"]] = int(c["n"].replace(",", ""))
        else:
            return None
    end = time.mktime(time.strptime(m["at"], "%Y-%m-%d %H:%M:%S")) + int(m["ms"]) / 1000
    return PhaseLine(m["clock"], end, span, spent, calls, counts)


def phase_shares(lines: Iterable[PhaseLine], t0: float, t1: float) -> dict[str, dict]:
    """Per clock, the busy share of each phase over the window t0..t1 (epoch seconds): each line's seconds weighted
    by the part of its span inside the window (a line covers the `span_s` before it was logged; its phases are
    taken as spread evenly over it). A clock logs nothing for a span it was idle in (under 1% busy), so "covered_s"
    (the window's seconds its lines cover) may be less than the window.

    >>> a = parse_phase_line("2025-01-02 03:04:10,000 INFO x: tail loop: 10.0 s: forward 50% (5.0 ms x 1000)")
    >>> phase_shares([a], a.end - 5, a.end + 5)["tail loop"]
    {'lines': 1, 'covered_s': 5.0, 'share': {'forward': 0.5}, 'ms_per_call': {'forward': 5.0}, 'counts': {}}
    """
    out: dict[str, dict] = {}
    for ln in lines:
        overlap = min(ln.end, t1) - max(ln.end - ln.span_s, t0)
        if overlap <= 0 or ln.span_s <= 0:
            continue
        w = overlap / ln.span_s
        acc = out.setdefault(ln.clock, {"lines": 0, "covered_s": 0.0, "spent": {}, "calls": {}, "counts": {}})
        acc["lines"] += 1
        acc["covered_s"] += overlap
        for k, v in ln.spent.items():
            acc["spent"][k] = acc["spent"].get(k, 0.0) + v * w
            acc["calls"][k] = acc["calls"].get(k, 0.0) + ln.calls[k] * w
        for k, n in ln.counts.items():
            acc["counts"][k] = acc["counts"].get(k, 0.0) + n * w
    return {
        clock: {
            "lines": a["lines"],
            "covered_s": round(a["covered_s"], 3),
            "share": {k: round(v / a["covered_s"], 3) for k, v in sorted(a["spent"].items(), key=lambda kv: -kv[1])},
            "ms_per_call": {
                k: round(1000 * v / a["calls"][k], 2) if a["calls"][k] else None for k, v in a["spent"].items()
            },
            "counts": {k: round(v) for k, v in a["counts"].items()},
        }
        for clock, a in out.items()
    }


def worker_phases(logs: dict[str, Path], t0: float, t1: float) -> dict[str, dict]:
    """`phase_shares` of every worker's log (by role) over the window t0..t1 (epoch seconds); a role whose log has no
    phase line in the window maps to {}."""
    out: dict[str, dict] = {}
    for role, path in logs.items():
        try:
            text = path.read_text(errors="replace")
        except OSError:
            out[role] = {}
            continue
        parsed = (parse_phase_line(line) for line in text.splitlines() if " s: " in line)
        out[role] = phase_shares((p for p in parsed if p is not None), t0, t1)
    return out


def gpu_busy(usage: dict | None, devices: dict[str, str]) -> dict[str, dict | None]:
    """GPU busy per role: the nvidia-smi figures (bench/usage.py) of the GPU each role's device is on (roles that
    share one GPU share its figures); None for a role off CUDA or without samples.

    >>> u = {"gpu": {"per_gpu": {"0": {"samples": 5, "mean_pct": 65.0, "busy_share": 0.7}}}}
    >>> gpu_busy(u, {"head": "cuda:0", "tail": "cpu"})
    {'head': {'gpu': 0, 'samples': 5, 'mean_pct': 65.0, 'busy_share': 0.7}, 'tail': None}
    """
    per_gpu = ((usage or {}).get("gpu") or {}).get("per_gpu") or {}
    out: dict[str, dict | None] = {}
    for role, device in devices.items():
        idx = gpu_indices([device])
        s = per_gpu.get(str(idx[0])) if idx else None
        out[role] = {"gpu": idx[0], **s} if s and s.get("samples") else None
    return out


def accounting(
    results: Sequence[dict],
    logs: dict[str, Path],
    window: tuple[float, float],
    usage: dict | None,
    devices: dict[str, str],
) -> dict:
    """A report row's accounting: `round_accounting` of its results, the workers' phase shares over `window`
    (epoch seconds: the batch's enqueue to its last result) and GPU busy per role."""
    return {
        "rounds": round_accounting(results),
        "phases": worker_phases(logs, *window),
        "window_s": round(window[1] - window[0], 3),
        "gpu_busy": gpu_busy(usage, devices),
    }


def _shares(clock: dict | None, window_s: float, top: int = 3) -> str:
    """A clock's busiest phases but "wait", in percent, its wait after, and the seconds of the batch its lines
    cover: "compute 61, replies 9 (wait 25) in 40 of 41 s"; "n/a" without lines.

    >>> _shares({"share": {"wait": 0.25, "compute": 0.61, "replies": 0.09}, "covered_s": 40.0}, 41.2)
    'compute 61, replies 9 (wait 25) in 40 of 41 s'
    """
    if not clock:
        return "n/a"
    share = clock["share"]
    busy = [f"{k} {100 * v:.0f}" for k, v in share.items() if k != "wait"][:top]
    wait = f" (wait {100 * share['wait']:.0f})" if "wait" in share else ""
    covered, window = (f"{x:.0f}" if x >= 10 else f"{x:.1f}" for x in (clock["covered_s"], window_s))
    return ", ".join(busy) + wait + f" in {covered} of {window} s"


def _gpu(busy: dict[str, dict | None]) -> str:
    """GPU busy per role: "head 65% / 0.70; tail ..." (a GPU shared by roles named once for all); "n/a" off CUDA."""
    by_gpu: dict[int, tuple[list[str], dict]] = {}
    for role, s in busy.items():
        if s is not None:
            by_gpu.setdefault(s["gpu"], ([], s))[0].append(role)
    cells = [f"{'+'.join(roles)} {s['mean_pct']:.0f}% / {s['busy_share']:.2f}" for roles, s in by_gpu.values()]
    return "; ".join(cells) or "n/a"


def _f(x: float | None) -> str:
    return "—" if x is None else f"{x:.1f}"


def markdown(rows: Sequence[dict], slot_cells: Sequence[str]) -> list[str]:
    """The second table of jobs.md: where a round goes, one line per report row with an accounting;
    `slot_cells`: each row's slot-empty cell (bench/jobs_waves.py `brief`)."""
    lines = [
        "",
        "Where a round goes (mean ms per round; round = draft + head + relay + tail queue + tail + verify + waiting "
        "for the head loop; send, prepare, back and hops are parts of the relay), the worker loops' busy % per phase "
        "over the batch (their logs' phase lines), GPU busy per role (mean / share of samples >= 50%), and how long a "
        "freed slot stood empty (ms, p50 / max, jobs that took a freed slot):",
        "",
        "| variant | N | round ms | draft | head | relay (send prepare back) | hops | tail queue | tail | verify | "
        "waiting for the head loop | head loop % | tail / stage loops % | GPU busy | slot empty ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for x, slots in zip(rows, slot_cells, strict=True):
        acc = x.get("accounting") or {}
        r, ph = acc.get("rounds") or {}, acc.get("phases") or {}
        p, rp = r.get("parts_ms") or {}, r.get("relay_parts_ms") or {}
        relay = f"{_f(p.get('relay_ms'))} ({' '.join(_f(rp.get(k)) for k in RELAY_PARTS)})"
        hops = " / ".join(_f(h) for h in r.get("hop_ms") or []) or "—"
        others = "; ".join(
            f"{role}: {_shares(clocks.get('tail loop'), acc['window_s'])}"
            for role, clocks in ph.items()
            if role != "head"
        )
        cells = [_f(r.get("round_ms")), _f(p.get("draft_ms")), _f(p.get("head_forward_ms")), relay, hops]
        cells += [_f(p.get(k)) for k in ("tail_queue_ms", "tail_forward_ms", "verify_ms")]
        cells += [
            _f(r.get("head_loop_wait_ms")),
            _shares((ph.get("head") or {}).get("head loop"), acc["window_s"]),
            others or "n/a",
        ]
        cells += [_gpu(acc.get("gpu_busy") or {}), slots]
        lines.append(f"| {x['variant']} | {x.get('n_label', x['n'])} | " + " | ".join(cells) + " |")
    return lines
