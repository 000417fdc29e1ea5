"""The files of the job-path benchmark (bench/jobs.py): jobs.json (everything), jobs.md (its tables: one line per
variant and N, where a round goes (bench/jobs_accounting.py), memory per worker) and jobs.png (with matplotlib). Not
run on its own: see `python -m bench.jobs --help`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench import jobs_accounting, jobs_waves
from bench.usage import brief


def _batched(x: dict | None) -> str:  # head / tail rounds per batched forward
    return f"{_f(x.get('head'), '.1f')} / {_f(x.get('tail'), '.1f')}" if isinstance(x, dict) else "—"


def _f(x: float | None, spec: str = ".2f") -> str:
    return "—" if x is None else format(x, spec)


def per_token(link: dict) -> str:
    """One link's bytes per committed token, up / down (bench/jobs.py `link_bytes`)."""
    return f"{_f(link.get('up_per_token'), ',.0f')} / {_f(link.get('down_per_token'), ',.0f')}"


def _links(x: dict) -> str:  # each worker's link: bytes per committed token, up / down
    return "; ".join(f"{role} {per_token(v)}" for role, v in (x.get("link_bytes") or {}).items()) or "—"


def _stages(x: dict) -> str:  # draft / head / relay (send, tail prepare, back) / tail queue / tail ms per round
    st = x.get("stage_ms_per_round") or {}
    parts = " ".join(_f(st.get(k), ".0f") for k in ("send_ms", "tail_prepare_ms", "back_ms"))
    keys = ("draft_ms", "head_forward_ms", "relay_ms", "tail_queue_ms", "tail_forward_ms")
    out = [_f(st.get(k), ".1f") for k in keys]
    out[2] += f" ({parts})"
    return " / ".join(out)


def parts_at(x: dict) -> str:
    """Where a row's mismatches part from their references: the first differing token of the earliest, the median
    and the latest (" from token A, median M, last L"), or of each where there are at most three; "" without any.
    (A row of N=1 jobs one at a time keeps the first 20 mismatches' tokens only.)"""
    at = x.get("first_diff_at") or sorted(d["first_diff_at"] for d in x.get("mismatch_detail", []))
    if not at:
        return ""
    if len(at) <= 3:
        return " at token " + ", ".join(str(a) for a in at)
    return f" from token {at[0]}, median {at[len(at) // 2]}, last {at[-1]}"


def markdown(rows: list[dict], seeds: str | None = None) -> str:
    """The report's tables: one line per (variant, N) (the steady state beside the whole batch's tok/s: between the
    first job's end and the last one's start, bench/jobs_waves.py), where a round goes (bench/jobs_accounting.py),
    memory per worker; `seeds` (what the jobs' seeds were) above them."""
    lines = [f"{seeds}", ""] if seeds else []
    lines += [
        "| variant | N | done | aggregate tok/s | steady-state tok/s | GPU busy: mean / share >= 50% | "
        "max threads head / tail | per-job tok/s p50 | latency p50 / p95 s | TTFT p50 / p95 s | tok/round | "
        "draft / head / relay (send prepare back) / tail queue / tail ms | "
        "rounds/forward head / tail | link B/token up / down | head / tail mem GB | mismatches |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for x in rows:
        lat, ttft, mem = x["latency_s"], x["ttft_s"], x.get("memory_gb", {})
        mism = "—" if x["mismatches"] is None else f"{x['mismatches']}/{x['checked']}" + parts_at(x)
        mism += f" ({x['ties']} at a tie, ≤ {x['tie_ulps_max']:.0f} ulps)" if x.get("ties") else ""
        n, jobs = x.get("n_label", x["n"]), x.get("one_at_a_time", x["n"])  # N=1: maybe jobs one at a time
        gpu, threads = brief(x.get("usage"))
        lines.append(
            f"| {x['variant']} | {n} | {x['finished']}/{jobs} | {_f(x['aggregate_tokens_per_s'])} | "
            f"{jobs_waves.brief(x)[0]} | {gpu} | "
            f"{threads} | {_f(x['per_job_tokens_per_s']['p50'])} | {_f(lat['p50'])} / {_f(lat['p95'])} | "
            f"{_f(ttft['p50'], '.3f')} / {_f(ttft['p95'], '.3f')} | {_f(x['tokens_per_round'])} | {_stages(x)} | "
            f"{_batched(x['rounds_batched_per_forward'])} | {_links(x)} | {_f(mem.get('head'))} / "
            f"{_f(mem.get('tail'))} | {mism} |"
        )
    counted = [x for x in rows if x.get("accounting")]
    lines += jobs_accounting.markdown(counted, [jobs_waves.brief(x)[1] for x in counted]) if counted else []
    for x in rows:
        if tl := x.get("timeline"):
            lines.append(
                f"\n{x['variant']} N={x.get('n_label', x['n'])}: 90% of first tokens by {tl['first_token_p90_s']} s, "
                f"10% of jobs done by {tl['done_p10_s']} s, about {_f(tl['mid_tokens_per_s'])} tok/s in between "
                f"(wall {x['wall_s']} s)"
            )
    notes = {(x.get("usage") or {}).get("gpu", {}).get("note") for x in rows} - {None}
    lines += [f"\nGPU utilization: {note}" for note in sorted(notes)]
    parts = [x for x in rows if x.get("memory_parts_gb")]
    if parts:
        lines += [
            "",
            "Memory per worker, GB (weights / KV caches / CUDA graphs as the worker logs them; process: nvidia-smi):",
            "",
        ]
        roles = list(dict.fromkeys(role for x in parts for role in x["memory_parts_gb"]))  # head, stage1.., tail
        lines += ["| variant | N | " + " | ".join(f"{r}: weights / caches / graphs / process" for r in roles) + " |"]
        lines += ["|---|---|" + "---|" * len(roles)]
        for x in parts:
            cells = []
            for role in roles:
                m = x["memory_parts_gb"].get(role) or {}
                proc = x.get("memory_gb", {}).get(role)
                cells.append(" / ".join(_f(v) for v in (m.get("weights"), m.get("caches"), m.get("graphs"), proc)))
            lines.append(f"| {x['variant']} | {x.get('n_label', x['n'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_outputs(out: Path, doc: dict) -> None:
    """jobs.json (everything), jobs.md (the tables) and, if matplotlib is installed, jobs.png."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "jobs.json").write_text(json.dumps(doc, indent=2))
    (out / "jobs.md").write_text(markdown(doc["rows"], doc.get("settings", {}).get("seeds")))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: jobs.png skipped", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for variant in dict.fromkeys(x["variant"] for x in doc["rows"]):
        pts = [(x["n"], x["aggregate_tokens_per_s"] or 0.0) for x in doc["rows"] if x["variant"] == variant]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=variant)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("jobs in the batch (N)")
    ax.set_ylabel("aggregate tokens/s")
    s = doc["settings"]
    ax.set_title(f"{s['model']}: {s['prompt_tokens']}+{s['new_tokens']} tokens, head link {s['link']}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "jobs.png", dpi=120)
    plt.close(fig)
