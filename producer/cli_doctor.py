"""`shardflow doctor`: check a Redis and the link to it, as one role's user sees them, and say what that link allows.

Run it on any role's machine with that role's URL (the same --redis-url, TLS options and ACL user the worker takes):

    shardflow doctor --redis-url 'rediss://head:PW@redis-vm:6380/0?ssl_ca_certs=ca.crt&ssl_certfile=...'
    shardflow doctor --json --jobs 1024            # a machine-readable report; predictions for 1,024 jobs

It measures (relay_broker/doctor.py: what, how, and which key each role's probe writes and deletes) the round trip
and jitter to Redis, the delivered bandwidth up and down, Redis's version, TLS, the ACL user, maxmemory,
maxmemory-policy, maxclients and the clock skew, and prints one verdict a line: ok, warn, fail, or skip (not
visible to this user). Then, for a model shape given by flags (default: the 7B split, Qwen2.5-7B's 3,584-wide
bfloat16 rows, a 0.5B drafter accepted at α = 0.78, 128 prompt + 128 new tokens), it recommends the draft length K,
the groups, the wire precision and compression for this link, and predicts the tok/s of one job and of --jobs N
(workers/speculative/adaptive.py: `link_k`, `link_groups`, `batch_rate`; the formula is in their docstrings).

The compute of a round of N jobs is --compute-ms + N x --session-ms, whatever K (CUDA graphs draft the longest K for
every row and pad every round to it), + --row-ms for each row sent (0: with graphs; a head without them pays per row).
The defaults are fitted to issue 58's measurements of that 7B split on one H100 shared by head and tail at 86 ms and no
bandwidth cap, K = 8: 1 job 32.95 tok/s (a round of 124 ms: 86 + 40 + 1.2) and 256 jobs 2,984 tok/s (351 ms:
40 + 256 x 1.215, the groups hiding the round trip). Out of that fit, the same model gives 1,084 and 1,306 tok/s
for its 200 Mbit/s runs at K = 8 and K = 3 (measured 981 and 1,256), and 3,237 for 1,024 jobs at 86 ms (3,009).
Measure your own (a `bench.jobs` run, or the head's phase lines) and pass them for other models and GPUs.

Which bandwidth a prediction uses: the head's up (it sends the rows), the tail's down (it reads them), else the
slower of the two. --assume-mbit / --assume-rtt-ms predict for another link (the checks still run).

Exit codes: 0 when no check fails (warnings and skips included), 1 when one does (e.g. maxmemory-policy is not
noeviction, a replica, a Redis older than 6.2), 4 when Redis cannot be reached or refuses the credentials.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from typing import Any

import click

from producer.options import EXIT_JOB_FAILED, EXIT_OK, CliConfig, prefix_opt, redis_opt, setting_default

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
FP8_BYTES = 1  # an 8-bit row (its scale left out)


@dataclass(frozen=True)
class Shape:
    """The model and the work a prediction is for (the flags)."""

    hidden: int
    dtype: str
    alpha: float
    new_tokens: int
    prompt_tokens: int
    compute_ms: float
    session_ms: float
    row_ms: float
    k_max: int
    jobs: int

    def compute(self, sessions: int) -> float:
        """A round's compute (ms) for `sessions` in flight, less what each of its rows adds (`row_ms`)."""
        return self.compute_ms + sessions * self.session_ms

    @property
    def row_bytes(self) -> int:
        return self.hidden * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class Plan:
    """What this link allows: the recommended settings and the predicted rates."""

    rtt_ms: float
    bandwidth_Bps: float | None  # None: not measured, predicted as no cap
    compress: bool
    wire_row_bytes: float
    k_one: int
    k_jobs: int
    groups: int
    rate_one: float
    rate_jobs: float
    rate_defaults: float  # K = k_max, uncompressed, groups as the head would pick them
    bytes_per_token: float  # on the wire per committed token, the prompts' rows counted
    bound: float | None  # the most tok/s the link carries at bytes_per_token
    link_bound: bool  # the link costs N jobs drafts, or its wire takes longer than a round's compute
    rate_fp8: float | None  # the same with 8-bit rows (opt-in, lossy), where the link bounds


def plan_link(shape: Shape, rtt_ms: float, bandwidth_Bps: float | None) -> Plan:
    """The recommendation and the predictions for a link (pure: the model of workers/speculative/adaptive.py)."""
    from schemas.codec import RATIO, worth_compressing
    from workers.head.groups import GAIN, MAX_GROUPS
    from workers.speculative.adaptive import batch_rate, bytes_per_token, link_groups, link_k

    s = shape
    k_cap = max(1, min(s.k_max, s.new_tokens - 1))
    ratio = RATIO if s.dtype == "bfloat16" else 1.0  # the codec's ratio is measured for bfloat16 rows only
    compress = worth_compressing(bandwidth_Bps, ratio=ratio)
    row = s.row_bytes / ratio if compress else float(s.row_bytes)

    def best(sessions: int, row_bytes: float, k: int | None = None) -> tuple[int, int, float]:
        link = (rtt_ms, s.compute(sessions), row_bytes, bandwidth_Bps)
        k = k or link_k(s.alpha, sessions, *link, k_cap, row_ms=s.row_ms)
        g = link_groups(k, sessions, *link, row_ms=s.row_ms, max_groups=MAX_GROUPS, gain=GAIN)
        return k, g, batch_rate(s.alpha, k, sessions, s.new_tokens, s.prompt_tokens, *link, row_ms=s.row_ms, groups=g)

    k_one, _, rate_one = best(1, row)
    k_jobs, groups, rate_jobs = best(s.jobs, row)
    _, _, rate_defaults = best(s.jobs, float(s.row_bytes), k=k_cap)
    per_token = bytes_per_token(s.alpha, k_jobs, row) + s.prompt_tokens * row / s.new_tokens  # prompts' rows too
    bound = bandwidth_Bps / per_token if bandwidth_Bps else None
    rows = s.jobs * (k_jobs + 1)
    wire_ms = 1000.0 * rows * row / bandwidth_Bps if bandwidth_Bps else 0.0
    k_free = link_k(s.alpha, s.jobs, rtt_ms, s.compute(s.jobs), row, None, k_cap, row_ms=s.row_ms)
    link_bound = k_jobs < k_free or wire_ms >= s.compute(s.jobs) + rows * s.row_ms  # the link shapes the plan
    rate_fp8 = None
    if link_bound:
        fp8_row = s.hidden * FP8_BYTES
        if fp8_row < row:
            _, _, rate_fp8 = best(s.jobs, float(fp8_row))
    return Plan(
        rtt_ms,
        bandwidth_Bps,
        compress,
        row,
        k_one,
        k_jobs,
        groups,
        rate_one,
        rate_jobs,
        rate_defaults,
        per_token,
        bound,
        link_bound,
        rate_fp8,
    )


def _bandwidth_for(role: str, up: float | None, down: float | None) -> float | None:
    """The head's up, the tail's down, else the slower known way."""
    if role == "head":
        return up or down
    if role == "tail":
        return down or up
    known = [x for x in (up, down) if x]
    return min(known) if known else None


def _recommendations(shape: Shape, plan: Plan, k_default: int) -> list[tuple[str, str]]:
    from relay_broker.doctor import mbit
    from schemas.codec import ENCODE_BYTES_PER_S

    k = (
        f"{plan.k_jobs} for {shape.jobs} jobs, {plan.k_one} for 1 job (a greedy job's head settles there from the "
        f"link it measures; requests' -k, now {k_default}, caps it)"
    )
    groups = f"{plan.groups} for {shape.jobs} jobs (shardflow head --groups {plan.groups}; by default it picks them)"
    wire = f"{shape.dtype}, lossless"
    if plan.rate_fp8 is not None and plan.rate_fp8 > 1.1 * plan.rate_jobs:
        wire += f" (8-bit rows would predict {plan.rate_fp8:,.0f} tok/s: opt-in, lossy: shardflow head --wire fp8)"
    link = mbit(plan.bandwidth_Bps) if plan.bandwidth_Bps else "no cap measured"
    if plan.compress:
        compression = (
            f"on: this link ({link}) is slower than the codec ({ENCODE_BYTES_PER_S / 1e6:.0f} MB/s to encode) pays "
            f"for, {shape.row_bytes / plan.wire_row_bytes:.2f}x fewer bytes (SHARDFLOW_RELAY__WIRE_CODEC=auto picks "
            "it, zstd forces it)"
        )
    else:
        compression = f"off: this link ({link}) is faster than the codec pays for (SHARDFLOW_RELAY__WIRE_CODEC=auto)"
        if shape.dtype != "bfloat16":
            compression = f"off: the codec's gain is measured for bfloat16 rows only ({link})"
    return [("K", k), ("groups", groups), ("wire", wire), ("compression", compression)]


def _prediction_line(shape: Shape, plan: Plan) -> str:
    line = f"1 job {plan.rate_one:,.1f} tok/s, {shape.jobs} jobs {plan.rate_jobs:,.0f} tok/s"
    line += f" (K = {shape.k_max}, uncompressed: {plan.rate_defaults:,.0f})"
    line += f"; {plan.bytes_per_token / 1e3:.1f} KB a committed token (prompts' rows counted)"
    if plan.bound is not None:
        line += f": this link carries at most {plan.bound:,.0f} tok/s"
    return line


@click.command()
@redis_opt
@prefix_opt
@click.option(
    "--role",
    type=click.Choice(["auto", "head", "tail", "producer", "admin"]),
    default="auto",
    show_default=True,
    help="The role whose keys the bandwidth probe writes; auto: from the URL's user (head-NAME: head).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON report instead of lines.")
@click.option("--pings", type=click.IntRange(1, 10_000), default=30, show_default=True, help="PINGs timed.")
@click.option(
    "--probe-mb",
    type=click.IntRange(0, 256),
    default=4,
    show_default=True,
    help="MiB written and read back (1 MiB a command, fewer on a slow link); 0: no bandwidth probe.",
)
@click.option("--jobs", type=click.IntRange(1), default=256, show_default=True, help="Jobs in flight to predict for.")
@click.option("--hidden", type=click.IntRange(1), default=3584, show_default=True, help="Hidden size of a row.")
@click.option(
    "--dtype",
    type=click.Choice(sorted(DTYPE_BYTES)),
    default="bfloat16",
    show_default=True,
    help="Dtype of the hidden rows on the wire.",
)
@click.option(
    "--alpha",
    type=click.FloatRange(0, 1, max_open=True),
    default=0.78,
    show_default=True,
    help="A draft's acceptance rate.",
)
@click.option("--new-tokens", type=click.IntRange(1), default=128, show_default=True, help="Tokens each job makes.")
@click.option(
    "--prompt-tokens", type=click.IntRange(0), default=128, show_default=True, help="Prompt tokens of each job."
)
@click.option(
    "--compute-ms",
    type=click.FloatRange(0),
    default=40.0,
    show_default=True,
    help="A round's compute that does not grow with the jobs in flight (ms).",
)
@click.option(
    "--session-ms",
    type=click.FloatRange(0),
    default=1.215,
    show_default=True,
    help="Compute each job in flight adds to a round (ms), whatever its K (CUDA graphs pad every row to the "
    "longest K). The defaults fit the 7B split on one H100 shared by head and tail (module docstring).",
)
@click.option(
    "--row-ms",
    type=click.FloatRange(0),
    default=0.0,
    show_default=True,
    help="Compute each row a round sends adds (ms; rows = jobs x (K + 1)): a head without graphs, or a CPU.",
)
@click.option(
    "-k",
    "--k-max",
    type=click.IntRange(1, 64),
    **setting_default("generation", "draft_k"),
    help="The longest draft length a request allows.",
)
@click.option(
    "--assume-mbit",
    type=click.FloatRange(0, min_open=True),
    default=None,
    help="Predict for this bandwidth (Mbit/s each way) instead of the measured one.",
)
@click.option(
    "--assume-rtt-ms",
    type=click.FloatRange(0),
    default=None,
    help="Predict for this round trip (ms) instead of the measured one.",
)
def doctor(
    redis_url: str,
    prefix: str,
    role: str,
    as_json: bool,
    pings: int,
    probe_mb: int,
    jobs: int,
    hidden: int,
    dtype: str,
    alpha: float,
    new_tokens: int,
    prompt_tokens: int,
    compute_ms: float,
    session_ms: float,
    row_ms: float,
    k_max: int,
    assume_mbit: float | None,
    assume_rtt_ms: float | None,
) -> None:
    """Check Redis and the link to it under this role's user, recommend K, groups, wire and compression for the
    link, and predict tok/s for 1 and --jobs N jobs. Exit 1 if a check fails."""
    from relay_broker.doctor import examine, safe_url

    config = CliConfig(redis={"url": redis_url, "prefix": prefix})
    r = config.redis
    try:
        exam = examine(
            r,
            config.redis_url,
            config.prefix,
            role=None if role == "auto" else role,  # type: ignore[arg-type]
            pings=pings,
            probe_bytes=probe_mb << 20,
        )
    finally:
        r.close()
    shape = Shape(hidden, dtype, alpha, new_tokens, prompt_tokens, compute_ms, session_ms, row_ms, k_max, jobs)
    up = exam.bandwidth.up_Bps if exam.bandwidth else None
    down = exam.bandwidth.down_Bps if exam.bandwidth else None
    bandwidth = assume_mbit * 1e6 / 8 if assume_mbit else _bandwidth_for(exam.role, up, down)
    rtt_ms = assume_rtt_ms if assume_rtt_ms is not None else exam.rtt.median_s * 1000.0
    plan = plan_link(shape, rtt_ms, bandwidth)

    findings = list(exam.findings)
    for i, f in enumerate(findings):  # the bandwidth check's verdict: does the link bound N jobs?
        if f.name == "bandwidth" and f.verdict == "ok" and plan.link_bound and not assume_mbit:
            note = f"; it bounds {jobs} jobs (see the recommendations)"
            findings[i] = dataclasses.replace(f, verdict="warn", detail=f.detail + note)
    failed = any(f.verdict == "fail" for f in findings)
    code = EXIT_JOB_FAILED if failed else EXIT_OK  # 1: a check failed
    recs = _recommendations(shape, plan, k_max)
    if as_json:
        report: dict[str, Any] = {
            "url": safe_url(config.redis_url),
            "role": exam.role,
            "user": exam.user,
            "checks": [f.as_dict() for f in findings],
            "link": {
                "rtt_ms": rtt_ms,
                "jitter_ms": exam.rtt.jitter_s * 1000.0,
                "up_Bps": up,
                "down_Bps": down,
                "bandwidth_Bps": bandwidth,
                "assumed": bool(assume_mbit or assume_rtt_ms is not None),
            },
            "shape": dataclasses.asdict(shape),
            "recommended": {
                "k_jobs": plan.k_jobs,
                "k_one": plan.k_one,
                "groups": plan.groups,
                "wire": dtype,
                "compression": plan.compress,
                "notes": dict(recs),
            },
            "predicted": {
                "one_job_tok_s": plan.rate_one,
                "jobs_tok_s": plan.rate_jobs,
                "jobs": jobs,
                "defaults_tok_s": plan.rate_defaults,
                "bytes_per_token": plan.bytes_per_token,
                "bandwidth_bound_tok_s": plan.bound,
                "link_bound": plan.link_bound,
                "fp8_tok_s": plan.rate_fp8,
            },
            "failed": failed,
            "exit_code": code,
        }
        click.echo(json.dumps(report, indent=2))
        sys.exit(code)
    who = exam.user or "the default user"
    click.echo(f"shardflow doctor: {safe_url(config.redis_url)} as {who} (role: {exam.role})")
    width = max(len(f.name) for f in findings)
    for f in findings:
        click.echo(f"  {f.verdict:<5} {f.name:<{width}}  {f.detail}")
    link = f"round trip {rtt_ms:.2f} ms, " + (
        f"{plan.bandwidth_Bps * 8 / 1e6:,.0f} Mbit/s" if plan.bandwidth_Bps else "no measured bandwidth cap"
    )
    link += " (assumed)" if assume_mbit or assume_rtt_ms is not None else ""
    click.echo(
        f"recommended for this link ({link}; hidden {hidden} {dtype}, α {alpha:g}, {prompt_tokens} + {new_tokens} "
        f"tokens, compute {compute_ms:g} ms + {session_ms:g} ms a job"
        + (f" + {row_ms:g} ms a row" if row_ms else "")
        + "):"
    )
    for name, text in recs:
        click.echo(f"  {name:<11}  {text}")
    click.echo(f"predicted: {_prediction_line(shape, plan)}")
    counts = {v: sum(f.verdict == v for f in findings) for v in ("fail", "warn", "skip")}
    summary = ", ".join(f"{n} {v}" for v, n in counts.items())
    click.echo(f"verdict: {'FAIL' if failed else 'ok'} ({summary}); exit {code}")
    sys.exit(code)
