"""The end-to-end job-path benchmark: real `shardflow tail` and `shardflow head` worker processes, an embedded Redis,
an emulated link between each worker and Redis (bench/link.py: bandwidth, delay, jitter, stalls; by default the
86 ms WAN to the head only), and batches of N jobs enqueued through the producer `Client`; for each N the aggregate
and per-job tokens/s, job latency, time to first token, the bytes each way per committed token through each link,
worker memory and (with --check) greedy outputs against Hugging Face `generate`: how many part from it, and at which
token each first differs (the table's mismatches column; `first_diff_at` in jobs.json), which is what a lossy wire
(`--head-args "--wire fp8"`) is to be judged by.

    # CPU: tiny random model, n-gram drafter, outputs checked against HF generate
    python -m bench.jobs --tiny --n 1,4,8 --new-tokens 32 --prompt-tokens 32 --check --out /tmp/jobs_tiny
    # SmolLM2-135M-Instruct as the demo runs it (n-gram drafter)
    python -m bench.jobs --smollm --n 1,8 --new-tokens 32 --out /tmp/jobs_smollm
    # the same with 8-bit rows on the wire (lossy): lossless and fp8 heads, outputs checked against HF generate
    python -m bench.jobs --smollm --n 8 --new-tokens 64 --check --variant lossless= --variant "fp8=--wire fp8"
    # any checkpoint; several worker configurations one after another; two notebooks' link, head and tail alike
    python -m bench.jobs --target DIR --split 14 [--draft DIR] --link notebooks --tail-link notebooks \\
        --variant default= --variant "c16=--concurrency 16" --variant "c16s32=--concurrency 16 | --slots 32"
    # GPU, random weights, synthetic acceptance (the worker plugin bench/synthetic.py)
    python -m bench.jobs --target random:qwen2.5-7b --split 14 --draft random:qwen2.5-0.5b --synthetic 0.78 \\
        --head-device cuda:0 --tail-device cuda:1 --dtype bfloat16 --link small-relay

Workers run with their default flags plus --head-args / --tail-args and a variant's own (`--variant NAME=HEAD ARGS[ |
TAIL ARGS]`, repeatable; each variant starts its own pair of workers, which serve every N in order after a warm-up
job). The head reaches Redis through its link (`--link SPEC`, default `wan`: 43 ms each way, no cap; it is the far
machine), the tail through its own (`--tail-link SPEC`, default `none`: local to Redis), each link a proxy process of
its own with its own wire (bench/link.py: the profiles and the spec syntax, e.g. `notebooks` or
`wan:mbit=100,jitter_ms=5`; `none`: a direct connection); the producer connects directly. A link's bytes per
committed token are what its proxy delivered each way while the batch ran (up: worker -> Redis, down: Redis ->
worker; all of that worker's traffic, RQ's included), over the batch's completion tokens. Writes jobs.json, jobs.md
and (with matplotlib) jobs.png to --out, worker logs to --out/logs; progress to stderr, the table to stdout.

Each job has its own sampling seed by default (job i of every N the same one), so the synthetic drafter's accept/reject
pattern differs from job to job as real traffic's would (`--same-seed`: none, every job rejects the same positions and
a batch steps in lockstep; greedy outputs do not depend on the seed). For each N the bench samples, while the batch
runs (bench/usage.py), GPU utilization (nvidia-smi every 200 ms: mean and share of samples >= 50%; skipped with a note
without nvidia-smi or CUDA workers) and the head's and tail's thread counts (/proc/PID/status; max)."""

from __future__ import annotations

import _thread
import dataclasses
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import click

from bench.jobs_models import Model, build_prompts, hf_references, resolve_model, say
from bench.jobs_report import (
    BatchRun,
    FirstTokens,
    git_state,
    memory_parts,
    parts_at,
    per_token,
    process_memory_gb,
    summarize,
    write_outputs,
)
from bench.jobs_requests import cycle, draft_dict, job_seed, plugin_args, request, seeds_note
from bench.jobs_singles import merge_singles
from bench.link import Counters, Link, SpawnedLink, parse_link, spawn_link
from bench.usage import Usage, brief
from producer.client import Client, Followed, JobEnded, TextChunk
from producer.local import stop_processes, wait_for_tails
from relay_broker.connection import connect
from relay_broker.embedded import EmbeddedRedis, child_setup
from schemas.keys import Keys
from schemas.requests import DraftSettings, GenerationRequest

REPO = Path(__file__).resolve().parents[1]


# --- workers --------------------------------------------------------------------------------------------------
def spawn(args: list[str], log: Path) -> subprocess.Popen:
    """`python -m producer ARGS` in a session of its own; it gets SIGTERM if the bench dies (Linux)."""
    with log.open("ab") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "producer", "-v", *args],  # -v: the loops' phase lines (info)
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=child_setup(True),
        )


class Watchdog(threading.Thread):
    """Interrupts the main thread (KeyboardInterrupt) if a worker process exits while the bench runs."""

    def __init__(self, procs: dict[str, subprocess.Popen]) -> None:
        super().__init__(daemon=True, name="watchdog")
        self.procs, self.died, self.done = procs, "", threading.Event()

    def run(self) -> None:
        while not self.done.wait(1.0):
            for role, p in self.procs.items():
                if p.poll() is not None and not self.done.is_set():
                    self.died = f"the {role} worker exited with {p.returncode}"
                    _thread.interrupt_main()
                    return


@dataclass(frozen=True)
class Config:
    """What every variant runs with."""

    kind: str  # drafter of the measured jobs
    k: int
    alpha: float | None
    new: int
    dtype: str
    head_device: str
    tail_device: str
    timeout: float
    singles: int  # prompts the N=1 row runs one job at a time
    seed: int | None  # prompt seed, from which each job's sampling seed comes; None: no seeds (--same-seed)


@dataclass(frozen=True)
class Urls:
    """Where each side reaches Redis: the producer directly, each worker directly or through its link."""

    producer: str
    tail: str
    head: str


@dataclass
class Workers:
    client: Client
    head: subprocess.Popen
    tail: subprocess.Popen
    logs: dict[str, Path]  # each worker's log file


@contextmanager
def start_workers(
    model: Model, cfg: Config, name: str, extra: tuple[list[str], list[str]], urls: Urls, logs: Path
) -> Iterator[Workers]:
    """A tail and a head worker for one variant, on a queue and key prefix of its own; yields once the tail
    reads its stream and the head has finished a small warm-up job."""
    prefix = f"jobs-{name}"
    common = ["--target", model.target, "--prefix", prefix, "--dtype", cfg.dtype]
    random_target, synthetic = model.target.startswith("random:"), cfg.alpha is not None
    tail_args = ["tail", *common, "--layers", f"{model.split}:{model.layers}", "--redis-url", urls.tail]
    tail_args += ["--device", cfg.tail_device, *plugin_args(synthetic, random_target), *extra[1]]
    head_args = ["head", *common, "--layers", f"0:{model.split}", "--redis-url", urls.head, "--queue", prefix]
    head_args += ["--device", cfg.head_device, *(["--draft", model.draft] if model.draft else [])]
    head_args += [*plugin_args(synthetic, random_target), *extra[0]]
    for args in (tail_args, head_args):
        say(f"variant {name}: shardflow {' '.join(shlex.quote(a) for a in args)}")
    tail = spawn(tail_args, logs / f"{name}-tail.log")
    head = spawn(head_args, logs / f"{name}-head.log")
    dog = Watchdog({"tail": tail, "head": head})
    try:
        dog.start()
        r = connect(urls.producer)
        wait_for_tails(r, Keys(prefix), proc=tail, timeout_s=900)
        client = Client(r, prefix=prefix, queue=prefix)
        # warm-up: one short job (not a measured prompt); the synthetic drafter needs references, so none there
        warm_kind = "none" if synthetic else cfg.kind
        warm = request([(i * 7 + 3) % model.vocab for i in range(16)], min(8, cfg.new), draft_dict(warm_kind, cfg.k))
        view = run_batch(client, [warm], 900, "warm-up").views[0]
        if view.status != "finished":
            raise click.ClickException(f"warm-up job {view.status}: {view.error}")
        say(f"variant {name}: workers ready")
        yield Workers(client, head, tail, {"head": logs / f"{name}-head.log", "tail": logs / f"{name}-tail.log"})
    except KeyboardInterrupt:
        if dog.died:
            raise click.ClickException(f"{dog.died} (see {logs})") from None
        raise
    finally:
        dog.done.set()
        stop_processes([head, tail], 20.0)


def run_batch(client: Client, reqs: list[GenerationRequest], timeout: float, label: str) -> BatchRun:
    """Enqueue one batch and follow it to the end, noting when each job's first text and end marker arrive."""
    t0 = time.time()
    batch = client.enqueue(reqs)
    run = BatchRun(t0, t0, batch.job_ids, [])
    watcher = FirstTokens(client.r, client.queue.started_job_registry.key, batch.job_ids)
    watcher.start()
    last_note = time.monotonic()
    for ev in client.follow(batch.job_ids, timeout=timeout):
        now = time.time()
        if isinstance(ev, TextChunk):
            run.first_seen.setdefault(ev.job_id, now)
            if ev.last:
                run.final_seen[ev.job_id] = now
        elif isinstance(ev, JobEnded):
            say(f"{label}: job {ev.view.job_id} ended {ev.view.status}: {ev.view.error}")
        elif isinstance(ev, Followed):
            run.views = ev.views
        if time.monotonic() - last_note > 10:
            last_note = time.monotonic()
            say(f"{label}: {len(run.final_seen)}/{len(reqs)} done, {len(run.first_seen)} streaming, {now - t0:.0f}s")
    run.t_done = time.time()
    watcher.done.set()
    watcher.join()
    run.meta_seen = dict(watcher.seen)
    for jid, job in zip(batch.job_ids, client.jobs(batch.job_ids), strict=True):
        if job is not None and not isinstance(job, str):
            enq, start, end = (
                t.timestamp() if t is not None else None for t in (job.enqueued_at, job.started_at, job.ended_at)
            )
            run.rq_times[jid] = (enq, start, end)
    return run


def link_option(spec: str, hint: str) -> Link | None:
    """A --link / --tail-link spec (bench/link.py's `parse_link`) as a click parameter."""
    try:
        return parse_link(spec)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint=hint) from None


def parse_variants(variants: tuple[str, ...], head_args: str, tail_args: str) -> list[tuple[str, list, list]]:
    """(name, head flags, tail flags) per `--variant NAME=HEAD ARGS[ | TAIL ARGS]`; one "default" if none."""
    out = []
    for v in variants or ("default=",):
        name, sep, rest = v.partition("=")
        if not sep or not name.replace("-", "").replace("_", "").isalnum():
            raise click.BadParameter(f"{v!r}: use NAME=HEAD ARGS[ | TAIL ARGS]", param_hint="--variant")
        head, _, tail = rest.partition("|")
        out.append((name, [*shlex.split(head_args), *shlex.split(head)], [*shlex.split(tail_args), *shlex.split(tail)]))
    return out


def link_bytes(
    links: dict[str, SpawnedLink], before: dict[str, Counters], tokens: int
) -> dict[str, dict[str, int | float | None]]:
    """Per worker with a link: the bytes its proxy delivered each way since `before`, and per committed token."""
    out: dict[str, dict[str, int | float | None]] = {}
    for role, link in links.items():
        d = link.counters() - before[role]
        per = {f"{k}_per_token": round(v / tokens, 1) if tokens else None for k, v in (("up", d.up), ("down", d.down))}
        out[role] = {"up": d.up, "down": d.down, **per}
    return out


def measure(
    w: Workers,
    name: str,
    cfg: Config,
    n: int,
    prompts: list,
    refs: list | None,
    synth: list | None,
    links: dict[str, SpawnedLink],
) -> dict:
    """One batch of N jobs on a variant's workers: its report row. N=1 runs `cfg.singles` prompts one job at a
    time and reports them as one row (bench/jobs_singles.py). `links`: each worker's link, by role."""
    reqs = [
        request(
            prompts[i],
            cfg.new,
            draft_dict(cfg.kind, cfg.k, cfg.alpha, synth[i] if synth else None),
            None if cfg.seed is None else job_seed(cfg.seed, i),
        )
        for i in range(max(n, cfg.singles if n == 1 else n))
    ]
    say(f"variant {name}: N={n} ..." + (f" ({len(reqs)} prompts, one job at a time)" if len(reqs) > n else ""))
    # sampled over the whole batch (N=1: its single jobs one after another)
    before = {role: link.counters() for role, link in links.items()}
    with Usage({"head": w.head.pid, "tail": w.tail.pid}, [cfg.head_device, cfg.tail_device]) as use:
        if n == 1:
            singles = []
            for i, req in enumerate(reqs):
                batch = run_batch(w.client, [req], cfg.timeout, f"N=1 #{i}")
                one = summarize(batch, refs[i : i + 1] if refs else None)
                for d in one.get("mismatch_detail", []):
                    d["index"] = i
                singles.append(one)
            row = {"variant": name, **merge_singles(singles)}
        else:
            row = {"variant": name, **summarize(run_batch(w.client, reqs, cfg.timeout, f"N={n}"), refs)}
    row["link_bytes"] = link_bytes(links, before, row["completion_tokens"])
    row["usage"], row["seeds"] = use.result, "same (none sent)" if cfg.seed is None else "per job"
    gpu = {"head": cfg.head_device.startswith("cuda"), "tail": cfg.tail_device.startswith("cuda")}
    row["memory_gb"] = {role: process_memory_gb(p.pid, gpu[role]) for role, p in (("head", w.head), ("tail", w.tail))}
    row["memory_parts_gb"] = {role: memory_parts(path) for role, path in w.logs.items()}
    lat, ttft = row["latency_s"], row["ttft_s"]
    gpu_use, threads = brief(use.result)
    say(
        f"variant {name}: N={n}: {row['aggregate_tokens_per_s']} tok/s aggregate, per-job p50 "
        f"{row['per_job_tokens_per_s']['p50']} tok/s, latency p50/p95 {lat['p50']}/{lat['p95']} s, TTFT p50/p95 "
        f"{ttft['p50']}/{ttft['p95']} s, mismatches {row['mismatches']}{parts_at(row)} (ties {row.get('ties', 0)}), "
        f"not finished {len(row['failed'])}; GPU mean / share >= 50%: {gpu_use}"
        + (f" ({use.result['gpu']['note']})" if use.result["gpu"]["note"] else "")
        + f"; max threads head / tail {threads}"
        + "".join(f"; {role} link B/token up / down {per_token(x)}" for role, x in row["link_bytes"].items())
    )
    return row


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--tiny", is_flag=True, help="Tiny random Qwen2-shaped model (workers/tiny_models.py), n-gram drafter.")
@click.option("--smollm", is_flag=True, help="SmolLM2-135M-Instruct as `shardflow demo` runs it, n-gram drafter.")
@click.option("--target", default=None, help="Target model directory (or random:<preset> with the bench plugin).")
@click.option("--split", type=int, default=None, help="First layer of the tail (default: half).")
@click.option("--draft", default=None, help="Draft model for the head (default: none: n-gram drafting).")
@click.option("--n", "ns", default="1,4,16,64,256", show_default=True, help="Batch sizes, run in this order.")
@click.option("--prompt-tokens", type=click.IntRange(1), default=128, show_default=True)
@click.option("--new-tokens", type=click.IntRange(1), default=128, show_default=True)
@click.option(
    "--drafter",
    type=click.Choice(["auto", "model", "ngram", "none"]),
    default="auto",
    show_default=True,
    help="auto: the draft model with --draft, else n-gram.",
)
@click.option(
    "-k", type=click.IntRange(0, 64), default=DraftSettings().k, show_default=True, help="Draft tokens/round."
)
@click.option("--check", is_flag=True, help="Check outputs against HF generate(do_sample=False) on the unsplit target.")
@click.option("--check-device", default="cpu", show_default=True, help="Device of the --check reference model.")
@click.option(
    "--synthetic",
    "alpha",
    type=click.FloatRange(0, 1),
    default=None,
    help="Synthetic drafter with this acceptance (random weights); references from --check or the job path.",
)
@click.option(
    "--link",
    "head_link",
    default="wan",
    show_default=True,
    callback=lambda _ctx, _param, spec: link_option(spec, "--link"),
    help="The head's link to Redis: a profile of bench/link.py (lan, wan, notebooks, small-relay, ...), with "
    "overrides (wan:mbit=100,jitter_ms=5), or none.",
)
@click.option(
    "--tail-link",
    default="none",
    show_default=True,
    callback=lambda _ctx, _param, spec: link_option(spec, "--tail-link"),
    help="The tail's link to Redis, as --link (none: the tail local to Redis).",
)
@click.option("--head-device", default="cpu", show_default=True)
@click.option("--tail-device", default="cpu", show_default=True)
@click.option(
    "--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto", show_default=True
)
@click.option("--head-args", default="", help="Extra `shardflow head` flags for every variant.")
@click.option("--tail-args", default="", help="Extra `shardflow tail` flags for every variant.")
@click.option("--variant", "variants", multiple=True, help="NAME=HEAD ARGS[ | TAIL ARGS] (repeatable).")
@click.option("--timeout", type=click.FloatRange(1), default=3600, show_default=True, help="Seconds per batch.")
@click.option("--seed", type=int, default=0, show_default=True, help="Prompt seed (jobs' seeds too).")
@click.option(
    "--same-seed",
    is_flag=True,
    help="Send no sampling seed (the old lockstep behaviour): every job's synthetic drafter rejects the same "
    "positions. Default: each job its own seed.",
)
@click.option(
    "--distinct",
    type=click.IntRange(1),
    default=None,
    help="Distinct prompts, cycled over the jobs (default: each job its own); references are made once each.",
)
@click.option(
    "--singles",
    type=click.IntRange(1),
    default=None,
    help="Prompts the N=1 row runs one job at a time, reported as one row (default: min(8, largest N)).",
)
@click.option("--out", type=click.Path(file_okay=False), default="bench/out/jobs", show_default=True)
def main(
    tiny: bool,
    smollm: bool,
    target: str | None,
    split: int | None,
    draft: str | None,
    ns: str,
    prompt_tokens: int,
    new_tokens: int,
    drafter: str,
    k: int,
    check: bool,
    check_device: str,
    alpha: float | None,
    head_link: Link | None,
    tail_link: Link | None,
    head_device: str,
    tail_device: str,
    dtype: str,
    head_args: str,
    tail_args: str,
    variants: tuple[str, ...],
    timeout: float,
    seed: int,
    same_seed: bool,
    distinct: int | None,
    singles: int | None,
    out: str,
) -> None:
    """Run the job-path benchmark (see the module docstring)."""
    try:
        sizes = [int(x) for x in ns.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{ns!r}: give N,N,...", param_hint="--n") from None
    if not sizes or min(sizes) < 1:
        raise click.BadParameter("give N >= 1", param_hint="--n")
    runs = parse_variants(variants, head_args, tail_args)
    out_dir = Path(out)
    logs = out_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="shardflow-bench-jobs-") as tmp, ExitStack() as stack:
        model = resolve_model(tiny, smollm, target, split, draft, Path(tmp))
        if check and model.target.startswith("random:"):
            raise click.UsageError("--check needs a checkpoint directory, not a random: target")
        kind = "synthetic" if alpha is not None else drafter
        kind = ("model" if model.draft else "ngram") if kind == "auto" else kind
        singles = min(max(sizes), 8) if singles is None else singles  # prompts enough for them, below
        jobs = max(*sizes, singles if 1 in sizes else 0)
        job_seeds = None if same_seed else seed
        cfg = Config(kind, k, alpha, new_tokens, dtype, head_device, tail_device, timeout, singles, job_seeds)
        say(f"{model.name}: split {model.split}/{model.layers - model.split}, drafter {kind}, N = {sizes}")
        say(seeds_note(same_seed))
        base = build_prompts(model, min(distinct or jobs, jobs), prompt_tokens, seed)
        if len({tuple(p) for p in base}) != len(base):
            raise click.ClickException("the prompts built are not distinct; try another --seed")
        prompts = cycle(base, jobs)
        refs = cycle(hf_references(model, base, new_tokens, check_device, dtype), jobs) if check else None
        server = stack.enter_context(EmbeddedRedis(die_with_parent=True))
        links = {
            role: stack.enter_context(spawn_link(server.port, link))
            for role, link in (("head", head_link), ("tail", tail_link))
            if link is not None
        }
        for role, link in (("head", head_link), ("tail", tail_link)):
            say(f"{role} <-> Redis: " + (link.describe() if link else "direct"))
        via = {role: f"redis://127.0.0.1:{link.port}/0" for role, link in links.items()}
        urls = Urls(server.url, via.get("tail", server.url), via.get("head", server.url))
        settings = {
            "model": model.name, "target": model.target, "split": model.split, "layers": model.layers,
            "draft": model.draft, "drafter": kind, "k": k, "alpha": alpha, "prompt_tokens": prompt_tokens,
            "new_tokens": new_tokens, "ns": sizes, "link": head_link.spec() if head_link else "none",
            "link_settings": dataclasses.asdict(head_link) if head_link else None,
            "tail_link": tail_link.spec() if tail_link else "none",
            "tail_link_settings": dataclasses.asdict(tail_link) if tail_link else None, "head_device": head_device,
            "tail_device": tail_device, "dtype": dtype, "check": check, "check_device": check_device,
            "variants": [{"name": n, "head_args": h, "tail_args": t} for n, h, t in runs], "distinct": len(base),
            "singles": singles, "seeds": seeds_note(same_seed),
            "reference_source": "hf generate" if refs is not None else None,
            "cpu_count": os.cpu_count(), "python": sys.version.split()[0], "commit": git_state(REPO),
        }  # fmt: skip
        doc: dict = {"command": [sys.executable, "-m", "bench.jobs", *sys.argv[1:]], "settings": settings, "rows": []}
        synth = refs
        for name, head_extra, tail_extra in runs:
            with start_workers(model, cfg, name, (head_extra, tail_extra), urls, logs) as w:
                if alpha is not None and synth is None:
                    say("synthetic drafter: reference continuations through the job path first (draft none)")
                    plain = [request(p, new_tokens, draft_dict("none", 0)) for p in base]
                    views = run_batch(w.client, plain, timeout, "refs").views
                    synth = cycle([v.result["token_ids"] if v.result else [] for v in views], jobs)
                    settings["reference_source"] = "job path, draft none (synthetic drafter only)"
                for n in sizes:
                    # greedy outputs against HF (--check) or else the job path's own no-speculation outputs
                    doc["rows"].append(measure(w, name, cfg, n, prompts, refs or synth, synth, links))
                    write_outputs(out_dir, doc)  # after every N: a cut-short run still reports
    write_outputs(out_dir, doc)
    click.echo((out_dir / "jobs.md").read_text())


if __name__ == "__main__":
    main()
