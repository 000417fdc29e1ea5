"""The end-to-end job-path benchmark: real `shardflow tail`, `shardflow stage` (with --stages above 2) and `shardflow
head` worker processes, an embedded Redis, an emulated link between each worker and Redis (bench/link.py: bandwidth,
delay, jitter, stalls; by default the 86 ms WAN to the head only), and batches of N jobs enqueued through the producer
`Client`; for each N the aggregate and per-job tokens/s, the steady state where a batch has more jobs than a head takes
at once, job latency, time to first token, where a round's milliseconds go, how long a freed slot stood empty, the
bytes each way per committed token through each link, worker memory and (with --check) greedy outputs against Hugging
Face `generate`: how many part from it, and at which token each first differs (the table's mismatches column;
`first_diff_at` in jobs.json), which is what a lossy wire (`--head-args "--wire fp8"`) is to be judged by.

    # CPU: tiny random model, n-gram drafter, outputs checked against HF generate
    python -m bench.jobs --tiny --n 1,4,8 --new-tokens 32 --prompt-tokens 32 --check --out /tmp/jobs_tiny
    # three workers (head 0:1, a middle stage 1:2, tail 2:4), and waves: 6 jobs, 2 at a time
    python -m bench.jobs --tiny --stages 3 --n 2,6 --new-tokens 16 --prompt-tokens 16 --check \
        --head-args "--concurrency 2" --out /tmp/jobs_stages
    # SmolLM2-135M-Instruct as the demo runs it (n-gram drafter)
    python -m bench.jobs --smollm --n 1,8 --new-tokens 32 --out /tmp/jobs_smollm
    # the same with 8-bit rows on the wire (lossy): lossless and fp8 heads, outputs checked against HF generate
    python -m bench.jobs --smollm --n 8 --new-tokens 64 --check --variant lossless= --variant "fp8=--wire fp8"
    # any checkpoint; several worker configurations one after another; two notebooks' link, head and tail alike
    python -m bench.jobs --target DIR --split 14 [--draft DIR] --link notebooks --tail-link notebooks \
        --variant default= --variant "c16=--concurrency 16" --variant "c16s32=--concurrency 16 | --slots 32"
    # four workers at explicit cuts, each 43 ms from Redis (every hop a round trip)
    python -m bench.jobs --target DIR --cuts 12,24,36 --link wan --tail-link wan --stage-link wan
    # GPU, random weights, synthetic acceptance (the worker plugin bench/synthetic.py)
    python -m bench.jobs --target random:qwen2.5-7b --split 14 --draft random:qwen2.5-0.5b --synthetic 0.78 \
        --head-device cuda:0 --tail-device cuda:1 --dtype bfloat16 --link small-relay
    # issue 60's long batch: 1,024 jobs on one GPU, 256 in flight: steady state, slot gaps, a round's accounting
    python -m bench.jobs --target random:qwen2.5-7b --split 14 --draft random:qwen2.5-0.5b --synthetic 0.78 \
        --head-device cuda:0 --tail-device cuda:0 --dtype bfloat16 --n 1,256,1024

Workers run with their default flags plus --head-args / --tail-args / --stage-args and a variant's own (`--variant
NAME=HEAD ARGS[ | TAIL ARGS]`, repeatable; each variant starts its own workers, which serve every N in order after a
warm-up job). The layers go to `--stages N` workers (default 2: the head and the tail, the tail from `--split`), split
evenly, or from the layers `--cuts A,B,..` name (where each worker after the head begins); the N-2 middle stages run
on the tail's device and are announced before the first job (bench/jobs_workers.py). The head reaches Redis through
its link (`--link SPEC`, default `wan`: 43 ms each way, no cap; it is the far machine), the tail through its own
(`--tail-link SPEC`, default `none`: local to Redis), each middle stage through one of its own (`--stage-link SPEC`,
default: the tail's), each link a proxy process of its own with its own wire (bench/link.py: the profiles and the
spec syntax, e.g. `notebooks` or `wan:mbit=100,jitter_ms=5`; `none`: a direct connection); the producer connects
directly. A link's bytes per committed token are what its proxy delivered each way while the batch ran (up: worker
-> Redis, down: Redis -> worker; all of that worker's traffic, RQ's included), over the batch's completion tokens.
Writes jobs.json, jobs.md and (with matplotlib) jobs.png to --out, worker logs to --out/logs; progress to stderr, the
tables to stdout.

Each job has its own sampling seed by default (job i of every N the same one), so the synthetic drafter's accept/reject
pattern differs from job to job as real traffic's would (`--same-seed`: none, every job rejects the same positions and
a batch steps in lockstep; greedy outputs do not depend on the seed). For each N the bench samples, while the batch
runs (bench/usage.py), GPU utilization (nvidia-smi every 200 ms: mean and share of samples >= 50%; skipped with a note
without nvidia-smi or CUDA workers) and the workers' thread counts (/proc/PID/status; max).

Beside the main table, for each N (jobs.json `accounting`, `waves`; jobs.md's second table):
- where a round goes (bench/jobs_accounting.py): mean ms per round of the draft, the head's forward, the relay (its
  send, the tail's preparation, the way back, each middle stage's hop), the tail's queue, forward and verification,
  and the rest of a round's wall time: waiting for the head loop; the worker loops' busy share per phase from the
  phase lines of their logs that fall in the batch (logged every 10 s: "n/a" for a short batch), GPU busy per role;
- waves (bench/jobs_waves.py): the steady-state tok/s between the first job's end and the last job's start (next to
  the whole batch's; "—" where every job started before the first ended) and how long each freed slot stood empty
  (p50 / max ms, over the jobs that took a freed slot)."""

from __future__ import annotations

import dataclasses
import itertools
import os
import shlex
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

import click

from bench import jobs_waves
from bench.jobs_accounting import accounting
from bench.jobs_models import build_prompts, hf_references, resolve_model, say
from bench.jobs_report import BatchRun, git_state, memory_parts, process_memory_gb, summarize
from bench.jobs_requests import cycle, draft_dict, job_seed, request, seeds_note
from bench.jobs_singles import merge_singles
from bench.jobs_tables import parts_at, per_token, write_outputs
from bench.jobs_workers import REPO, Config, Urls, Workers, layer_cuts, run_batch, stage_roles, start_workers
from bench.link import Counters, Link, SpawnedLink, parse_link, spawn_link
from bench.usage import Usage, brief
from relay_broker.embedded import EmbeddedRedis
from schemas.requests import DraftSettings


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
    runs: list[BatchRun] = []
    with Usage({role: p.pid for role, p in w.procs.items()}, [cfg.head_device, cfg.tail_device]) as use:
        if n == 1:
            singles = []
            for i, req in enumerate(reqs):
                runs.append(run_batch(w.client, [req], cfg.timeout, f"N=1 #{i}"))
                one = summarize(runs[-1], refs[i : i + 1] if refs else None)
                for d in one.get("mismatch_detail", []):
                    d["index"] = i
                singles.append(one)
            row = {"variant": name, **merge_singles(singles)}
        else:
            runs.append(run_batch(w.client, reqs, cfg.timeout, f"N={n}"))
            row = {"variant": name, **summarize(runs[-1], refs)}
    row["link_bytes"] = link_bytes(links, before, row["completion_tokens"])
    row["usage"], row["seeds"] = use.result, "same (none sent)" if cfg.seed is None else "per job"
    devices = cfg.devices()
    row["memory_gb"] = {role: process_memory_gb(p.pid, devices[role].startswith("cuda")) for role, p in w.procs.items()}
    row["memory_parts_gb"] = {role: memory_parts(path) for role, path in w.logs.items()}
    results = [v.result for run in runs for v in run.views if v.status == "finished" and v.result]
    window = (runs[0].t0, runs[-1].t_done)
    row["accounting"] = accounting(results, w.logs, window, use.result, devices)
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
        + round_note(row)
    )
    return row


def round_note(row: dict) -> str:
    """A row's round in brief, for the progress line: its wall ms, the rest the head loop kept it waiting, each
    middle stage's hop, the steady state and how long freed slots stood empty."""
    r = (row.get("accounting") or {}).get("rounds") or {}
    steady, gaps = jobs_waves.brief(row)
    hops = " / ".join(f"{h:.1f}" for h in r.get("hop_ms") or []) or "—"
    return (
        f"; round {r.get('round_ms')} ms, of which waiting for the head loop {r.get('head_loop_wait_ms')} ms, hops "
        f"{hops} ms; steady-state tok/s {steady}; slot empty p50 / max ms {gaps}"
    )


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--tiny", is_flag=True, help="Tiny random Qwen2-shaped model (workers/tiny_models.py), n-gram drafter.")
@click.option("--smollm", is_flag=True, help="SmolLM2-135M-Instruct as `shardflow demo` runs it, n-gram drafter.")
@click.option("--target", default=None, help="Target model directory (or random:<preset> with the bench plugin).")
@click.option(
    "--split",
    type=int,
    default=None,
    help="First layer of the tail (default: half; two stages only: --cuts or --stages win).",
)
@click.option(
    "--stages",
    type=click.IntRange(2),
    default=None,
    help="Workers the layers are split over, evenly: the head, N-2 middle stages (`shardflow stage`), the tail "
    "[default: 2, or what --cuts makes].",
)
@click.option("--cuts", default=None, help="First layer of each worker after the head (8,16,24: four stages).")
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
@click.option(
    "--stage-link",
    default=None,
    callback=lambda _ctx, _param, spec: None if spec is None else (spec, link_option(spec, "--stage-link")),
    help="Each middle stage's link to Redis (one proxy each), as --link [default: the tail's].",
)
@click.option("--head-device", default="cpu", show_default=True)
@click.option("--tail-device", default="cpu", show_default=True, help="The tail's device (the middle stages' too).")
@click.option(
    "--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto", show_default=True
)
@click.option("--head-args", default="", help="Extra `shardflow head` flags for every variant.")
@click.option("--tail-args", default="", help="Extra `shardflow tail` flags for every variant.")
@click.option("--stage-args", default="", help="Extra `shardflow stage` flags for every middle stage.")
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
    stages: int | None,
    cuts: str | None,
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
    stage_link: tuple[str, Link | None] | None,
    head_device: str,
    tail_device: str,
    dtype: str,
    head_args: str,
    tail_args: str,
    stage_args: str,
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
        at = layer_cuts(model.layers, stages, cuts, split)
        cfg = Config(kind, k, alpha, new_tokens, dtype, head_device, tail_device, timeout, singles, job_seeds)
        cfg = dataclasses.replace(cfg, cuts=at, stage_args=tuple(shlex.split(stage_args)))
        bounds = [0, *at, model.layers]
        ranges = ", ".join(f"{a}:{b}" for a, b in itertools.pairwise(bounds))
        say(f"{model.name}: layers {ranges} over {len(at) + 1} workers, drafter {kind}, N = {sizes}")
        say(seeds_note(same_seed))
        base = build_prompts(model, min(distinct or jobs, jobs), prompt_tokens, seed)
        if len({tuple(p) for p in base}) != len(base):
            raise click.ClickException("the prompts built are not distinct; try another --seed")
        prompts = cycle(base, jobs)
        refs = cycle(hf_references(model, base, new_tokens, check_device, dtype), jobs) if check else None
        server = stack.enter_context(EmbeddedRedis(die_with_parent=True))
        st_link = tail_link if stage_link is None else stage_link[1]
        roles = stage_roles(at)
        wires = [("head", head_link), *((role, st_link) for role in roles), ("tail", tail_link)]
        links = {role: stack.enter_context(spawn_link(server.port, link)) for role, link in wires if link is not None}
        for role, link in wires:
            say(f"{role} <-> Redis: " + (link.describe() if link else "direct"))
        via = {role: f"redis://127.0.0.1:{link.port}/0" for role, link in links.items()}
        stage_urls = tuple(via.get(role, server.url) for role in roles)
        urls = Urls(server.url, via.get("tail", server.url), via.get("head", server.url), stage_urls)
        settings = {
            "model": model.name, "target": model.target, "split": model.split, "layers": model.layers,
            "draft": model.draft, "drafter": kind, "k": k, "alpha": alpha, "prompt_tokens": prompt_tokens,
            "new_tokens": new_tokens, "ns": sizes, "link": head_link.spec() if head_link else "none",
            "link_settings": dataclasses.asdict(head_link) if head_link else None,
            "tail_link": tail_link.spec() if tail_link else "none",
            "tail_link_settings": dataclasses.asdict(tail_link) if tail_link else None, "stages": len(at) + 1,
            "cuts": list(at), "stage_link": st_link.spec() if st_link else "none",
            "stage_args": stage_args, "head_device": head_device,
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
