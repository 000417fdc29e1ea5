"""The measured side of the job-path benchmark (bench/jobs.py): per-N figures from the producer's views, RQ's job
timestamps and token-stream arrival times, worker memory; the files they go to are bench/jobs_tables.py's. Not run on
its own: see `python -m bench.jobs --help`.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis
from rq.job import Job

from bench.jobs_models import Reference
from bench.jobs_waves import waves

# the parts of a round the result's RoundTimings sum (schemas/requests.py)
STAGE_KEYS = (
    *("draft_ms", "head_forward_ms", "relay_ms", "send_ms", "tail_prepare_ms", "back_ms", "tail_queue_ms"),
    *("tail_forward_ms", "verify_ms", "total_ms"),
)


def git_state(repo: Path) -> str | None:
    """The commit the bench runs from, `+dirty` if the work tree differs from it; None outside git."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None
    return (commit + ("+dirty" if dirty else "")) or None


def pct(xs: list[float], q: float) -> float | None:
    """The q-quantile (0..1) of xs by linear interpolation between order statistics; None if empty."""
    if not xs:
        return None
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def dist(xs: list[float]) -> dict[str, float | None]:
    """p50 / p95 / mean / max of xs (None where xs is empty), rounded for the report."""

    def r(x: float | None) -> float | None:
        return None if x is None else round(x, 4)

    return {
        "p50": r(pct(xs, 0.5)),
        "p95": r(pct(xs, 0.95)),
        "mean": r(sum(xs) / len(xs)) if xs else None,
        "max": r(max(xs)) if xs else None,
    }


def process_memory_gb(pid: int, gpu: bool) -> float | None:
    """A worker process's memory: on GPU the memory nvidia-smi says it holds (torch's caching allocator
    keeps its peak), else its peak resident set (VmHWM of /proc/PID/status). None when it cannot be read."""
    try:
        if gpu:
            out = subprocess.run(
                ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout
            rows = [line.split(",") for line in out.splitlines() if "," in line]
            return round(sum(float(used) for owner, used in rows if int(owner) == pid) * 2**20 / 1e9, 3)
        status = Path(f"/proc/{pid}/status").read_text()
        kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:"))
        return round(kib * 1024 / 1e9, 3)
    except (OSError, ValueError, StopIteration, subprocess.SubprocessError):
        return None


class FirstTokens(threading.Thread):
    """When each running job's meta first reports a committed token: the head writes its progress right
    after a job's first round, in the same pipeline as the first text chunk, but a first token with no
    visible text (a special token, half a UTF-8 character) streams no chunk, so the text stream alone can be
    a progress interval late. Polls only the jobs in the queue's started registry (two round trips a poll)."""

    def __init__(self, r: redis.Redis, started_key: str, job_ids: list[str], interval_s: float = 0.02) -> None:
        super().__init__(daemon=True, name="first-tokens")
        self.r, self.key, self.wanted, self.interval_s = r, started_key, set(job_ids), interval_s
        self.seen: dict[str, float] = {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.interval_s):
            try:
                running = {m.decode().split(":", 1)[0] for m in self.r.zrange(self.key, 0, -1)}
                todo = sorted((running & self.wanted) - self.seen.keys())
                with self.r.pipeline(transaction=False) as pipe:
                    for j in todo:
                        pipe.hget(Job.key_for(j), "meta")
                    metas = pipe.execute() if todo else []
            except redis.RedisError:
                continue
            now = time.time()
            for j, raw in zip(todo, metas, strict=True):
                try:
                    tokens = json.loads(raw)["progress"]["tokens"]
                except (TypeError, ValueError, KeyError):
                    continue
                if isinstance(tokens, int) and tokens >= 1:
                    self.seen[j] = now


@dataclass
class BatchRun:
    """What the bench saw of one batch: when it enqueued (epoch seconds), per job id when its first text
    chunk and its end marker reached the producer, when the last job was seen final, the views, and RQ's
    (enqueued_at, started_at, ended_at) per job as epoch seconds (None where RQ has none)."""

    t0: float
    t_done: float
    job_ids: list[str]
    views: list  # producer.views.JobView
    first_seen: dict[str, float] = field(default_factory=dict)
    meta_seen: dict[str, float] = field(default_factory=dict)  # FirstTokens.seen
    final_seen: dict[str, float] = field(default_factory=dict)
    rq_times: dict[str, tuple[float | None, float | None, float | None]] = field(default_factory=dict)


def summarize(run: BatchRun, refs: list[list[int]] | None) -> dict:
    """One row of the report: a batch of N jobs (N = len(run.job_ids)). An output that parts from a `Reference`
    (HF `generate`) in half precision where generate's logits were within `TIE_ULPS` counts as a tie, not a
    mismatch."""
    done = [v for v in run.views if v.status == "finished" and v.result]
    results = [v.result for v in done]
    completion = sum(int(x.get("completion_tokens", 0)) for x in results)
    # first enqueue -> last result: the last end marker seen (written once the result is stored), or when the
    # batch was seen final if some finished job's marker never came
    seen_all = all(v.job_id in run.final_seen for v in done)
    wall = (max(run.final_seen.values()) if seen_all and run.final_seen else run.t_done) - run.t0
    latency: list[float] = []
    queued: list[float] = []
    running: list[float] = []
    for jid in run.job_ids:
        enq, start, end = run.rq_times.get(jid, (None, None, None))
        if enq is not None and end is not None:
            latency.append(end - enq)
        if enq is not None and start is not None:
            queued.append(start - enq)
        if start is not None and end is not None:
            running.append(end - start)
    rounds = sum(int(x.get("rounds", 0)) for x in results)
    inf = float("inf")
    started = [j for j in run.job_ids if j in run.first_seen or j in run.meta_seen]
    row: dict = {
        "n": len(run.job_ids),
        "finished": len(done),
        "failed": [f"{v.job_id}: {v.status}: {v.error}" for v in run.views if v.status != "finished"],
        "completion_tokens": completion,
        "wall_s": round(wall, 4),
        "aggregate_tokens_per_s": round(completion / wall, 3) if wall > 0 else None,
        "per_job_tokens_per_s": dist([float(x.get("tokens_per_s", 0.0)) for x in results]),
        # enqueue -> result, as the producer sees it: the job's end marker on its token stream (written right
        # after the result is stored) reaching Client.follow; one clock, the producer's
        "latency_s": dist([run.final_seen[j] - run.t0 for j in run.job_ids if j in run.final_seen]),
        # the same by RQ's timestamps (enqueued_at by the producer, ended_at by the head worker once RQ's own
        # bookkeeping after the job function is done, so a few head <-> Redis round trips later)
        "latency_rq_s": dist(latency),
        "queue_wait_s": dist(queued),  # enqueued_at -> started_at (includes RQ's dequeue bookkeeping)
        "run_s": dist(running),  # started_at -> ended_at
        # enqueue -> first token, as the producer sees it: the earlier of the job's first text chunk (Client.follow)
        # and its meta's first progress report (FirstTokens); the text-only figure beside it
        "ttft_s": dist([min(run.first_seen.get(j, inf), run.meta_seen.get(j, inf)) - run.t0 for j in started]),
        "ttft_text_s": dist([run.first_seen[j] - run.t0 for j in run.job_ids if j in run.first_seen]),
        "tokens_per_round": round(completion / rounds, 3) if rounds else None,
        "mean_accepted_per_round": dist([float(x.get("mean_accepted", 0.0)) for x in results]),
        # rounds per batched forward as a round sees it: the size of the head's / tail's batch that computed
        # each round (RoundTimings.head_batch_rounds / tail_batch_rounds), averaged over rounds
        "rounds_batched_per_forward": {
            side: round(sum(int(x.get("timings", {}).get(f"{side}_batch_rounds", 0)) for x in results) / rounds, 1)
            if rounds
            else None
            for side in ("head", "tail")
        },
        # where a round's time goes, summed over every job's rounds (the result's RoundTimings)
        "stage_ms_per_round": {
            k: round(sum(float(x.get("timings", {}).get(k, 0.0)) for x in results) / rounds, 2) if rounds else None
            for k in STAGE_KEYS
        },
        "replays": sum(int(x.get("replays", 0)) for x in results),
        "resumed_tokens": sum(int(x.get("resumed_tokens", 0)) for x in results),
        "timeline": timeline(run, done),
        # more jobs than the head takes at once: the steady state between the first wave's end and the last one's
        # start, and how long a freed slot stood empty (bench/jobs_waves.py)
        "waves": waves(
            [
                (
                    *run.rq_times.get(v.job_id, (None, None, None))[1:],
                    v.result.get("timings", {}).get("total_ms"),
                    int(v.result.get("completion_tokens", 0)),
                )
                for v in done
            ],
            run.t0,
        ),
    }
    if refs is not None:
        from workers.tiny_models import TIE_ULPS

        bad, tied = [], []
        for v in done:
            want = refs[v.index]
            got = v.result["token_ids"] if v.result else []
            ulps = want.tie_ulps(got) if got != want and isinstance(want, Reference) else None
            if ulps is not None and ulps <= TIE_ULPS:
                tied.append(ulps)
            elif got != want:
                at = next(
                    (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want))
                )
                bad.append({"index": v.index, "first_diff_at": at, "got_len": len(got), "want_len": len(want)})
        row["checked"] = len(done)
        row["mismatches"], row["ties"], row["tie_ulps_max"] = len(bad), len(tied), max(tied, default=None)
        row["first_diff_at"] = sorted(d["first_diff_at"] for d in bad)  # where each mismatch parts, every one
        row["mismatch_detail"] = bad[:20]
    else:
        row["checked"], row["mismatches"], row["ties"] = 0, None, 0
    return row


def timeline(run: BatchRun, done: list) -> dict | None:
    """Where a batch's wall time goes beside its steady middle: when 90% of its jobs had a first token, when the
    first 10% were done, and the tokens per second in between, each job's tokens spread evenly from its first token
    to its end marker (an estimate: the head streams progress in chunks). None without those marks."""
    inf = float("inf")
    spans = []
    for v in done:
        first = min(run.first_seen.get(v.job_id, inf), run.meta_seen.get(v.job_id, inf))
        end = run.final_seen.get(v.job_id)
        if first < inf and end is not None and end > first:
            spans.append((first - run.t0, end - run.t0, int(v.result.get("completion_tokens", 0))))
    if len(spans) < 2:
        return None
    t_a = pct([a for a, _, _ in spans], 0.9) or 0.0
    t_b = pct([b for _, b, _ in spans], 0.1) or 0.0
    mid = None
    if t_b > t_a:
        got = sum(n * max(0.0, min(b, t_b) - max(a, t_a)) / (b - a) for a, b, n in spans)
        mid = round(got / (t_b - t_a), 2)
    return {"first_token_p90_s": round(t_a, 3), "done_p10_s": round(t_b, 3), "mid_tokens_per_s": mid}


MEMORY_LINE = re.compile(r"ready \(.*memory: weights ([\d.]+) GB, caches ([\d.]+) GB, graphs ([\d.]+) GB")


def memory_parts(log_file: Path) -> dict[str, float] | None:
    """A worker's weights, KV caches and CUDA-graph memory in GB as its "ready" line in its log says (graphs
    captured later, at first use, show in the process's memory)."""
    try:
        text = log_file.read_text(errors="replace")
    except OSError:
        return None
    found = MEMORY_LINE.findall(text)
    if not found:
        return None
    return {part: float(v) for part, v in zip(("weights", "caches", "graphs"), found[-1], strict=True)}
