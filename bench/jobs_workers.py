"""The worker processes of bench/jobs.py: a tail, the middle stages of `--stages N` (`shardflow stage`, each behind a
link of its own) and a head, one set per variant, each a `python -m producer` process of its own; and one batch of
jobs enqueued through the producer `Client` and followed to its end. Not run on its own: see
`python -m bench.jobs --help`.

The model's layers go to the workers at `cuts`: the head runs 0:cuts[0], the i-th middle stage cuts[i-1]:cuts[i],
the tail cuts[-1]:L (`layer_cuts`: an even split, or the starts given). The tail and the stages are started first and
the head beside them (each process's imports take seconds: started one after another they would add up); the first
job, a warm-up, is enqueued only once the tail reads its stream and every stage has announced its range (`stages` of
the prefix), and a head reads the announced stages at its first generation (workers/head/routes.py), so every job's
route goes through them.
"""

from __future__ import annotations

import _thread
import itertools
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import click
import redis

from bench.jobs_models import Model, say
from bench.jobs_report import BatchRun, FirstTokens
from bench.jobs_requests import draft_dict, plugin_args, request
from producer.client import Client, Followed, JobEnded, TextChunk
from producer.local import stop_processes, wait_for_tails
from relay_broker.connection import connect
from relay_broker.embedded import child_setup
from schemas.keys import Keys
from schemas.requests import GenerationRequest

REPO = Path(__file__).resolve().parents[1]


def layer_cuts(layers: int, stages: int | None, cuts: str | None, split: int | None) -> tuple[int, ...]:
    """Where each worker after the head begins: `cuts` ("8,16,24") as given, else `stages` workers' even split
    (default 2: head and tail, the tail from `split` or half the layers; `split` is ignored beyond 2).

    >>> layer_cuts(32, 4, None, None), layer_cuts(4, 3, None, None), layer_cuts(28, None, None, 14)
    ((8, 16, 24), (1, 2), (14,))
    >>> layer_cuts(32, None, "8,20", None)
    (8, 20)
    """
    n = stages or 2
    if cuts is not None:
        try:
            out = tuple(int(c) for c in cuts.split(",") if c.strip())
        except ValueError:
            raise click.BadParameter(f"{cuts!r}: give A,B,... (layers)", param_hint="--cuts") from None
        if stages is not None and stages != len(out) + 1:
            raise click.BadParameter(f"{len(out)} cuts make {len(out) + 1} stages, not {stages}", param_hint="--cuts")
    elif n == 2:
        out = (layers // 2 if split is None else split,)
    else:
        if split is not None:  # bench/device.sh passes one always
            say(f"--split {split} ignored: --stages {n} splits the layers evenly (--cuts: starts of your own)")
        if n > layers:
            raise click.BadParameter(f"{n}: more than the model's {layers} layers", param_hint="--stages")
        out = tuple(i * layers // n for i in range(1, n))
    if not out or list(out) != sorted(set(out)) or not 0 < out[0] or out[-1] >= layers:
        raise click.BadParameter(f"{out}: increasing layers in 1..{layers - 1}", param_hint="--cuts")
    return out


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
            for role, p in list(self.procs.items()):
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
    tail_device: str  # the middle stages' too
    timeout: float
    singles: int  # prompts the N=1 row runs one job at a time
    seed: int | None  # prompt seed, from which each job's sampling seed comes; None: no seeds (--same-seed)
    cuts: tuple[int, ...] = ()  # where each worker after the head begins (`layer_cuts`); (): the model's split
    stage_args: tuple[str, ...] = ()  # extra `shardflow stage` flags

    def devices(self) -> dict[str, str]:
        """Each role's device: the head's, each middle stage's and the tail's."""
        return {
            "head": self.head_device,
            **{r: self.tail_device for r in stage_roles(self.cuts)},
            "tail": self.tail_device,
        }


def stage_roles(cuts: tuple[int, ...]) -> list[str]:
    """The middle stages' roles ("stage1", ...) for these cuts (one fewer than the cuts)."""
    return [f"stage{i}" for i in range(1, len(cuts))]


@dataclass(frozen=True)
class Urls:
    """Where each side reaches Redis: the producer directly, each worker directly or through its link."""

    producer: str
    tail: str
    head: str
    stages: tuple[str, ...] = ()  # each middle stage's, in layer order


@dataclass
class Workers:
    client: Client
    procs: dict[str, subprocess.Popen]  # by role: head, stage1.., tail
    logs: dict[str, Path]  # each worker's log file, by role


def wait_for_stages(r: redis.Redis, names: Keys, want: set[str], procs: dict[str, subprocess.Popen]) -> None:
    """Block until every member of `want` ("NAME A:B") is announced in the prefix's `stages`."""
    deadline = time.monotonic() + 900
    while not want <= {m.decode() for m in r.zrange(names.stages, 0, -1)}:
        for role, p in procs.items():
            if p.poll() is not None:
                raise click.ClickException(f"the {role} worker exited with {p.returncode} before it announced itself")
        if time.monotonic() > deadline:
            raise click.ClickException(f"the middle stages were not announced within 900 s: {sorted(want)}")
        time.sleep(0.1)


@contextmanager
def start_workers(
    model: Model, cfg: Config, name: str, extra: tuple[list[str], list[str]], urls: Urls, logs: Path
) -> Iterator[Workers]:
    """A tail, the middle stages and a head for one variant, on a queue and key prefix of its own; yields once the
    tail reads its stream, the stages are announced and the head has finished a small warm-up job."""
    prefix = f"jobs-{name}"
    cuts = cfg.cuts or (model.split,)
    common = ["--target", model.target, "--prefix", prefix, "--dtype", cfg.dtype]
    random_target, synthetic = model.target.startswith("random:"), cfg.alpha is not None
    tail_args = ["tail", *common, "--layers", f"{cuts[-1]}:{model.layers}", "--redis-url", urls.tail]
    tail_args += ["--device", cfg.tail_device, *plugin_args(synthetic, random_target), *extra[1]]
    stage_args: dict[str, list[str]] = {}
    for role, (a, b), url in zip(stage_roles(cuts), itertools.pairwise(cuts), urls.stages, strict=True):
        stage_args[role] = ["stage", *common, "--layers", f"{a}:{b}", "--redis-url", url, "--name", f"{role}-{name}"]
        stage_args[role] += ["--device", cfg.tail_device, *plugin_args(synthetic, random_target), *cfg.stage_args]
    head_args = ["head", *common, "--layers", f"0:{cuts[0]}", "--redis-url", urls.head, "--queue", prefix]
    head_args += ["--device", cfg.head_device, *(["--draft", model.draft] if model.draft else [])]
    head_args += [*plugin_args(synthetic, random_target), *extra[0]]
    argv = {"tail": tail_args, **stage_args, "head": head_args}
    for args in argv.values():
        say(f"variant {name}: shardflow {' '.join(shlex.quote(a) for a in args)}")
    roles = ["head", *stage_args, "tail"]
    log_files = {role: logs / f"{name}-{role}.log" for role in roles}
    procs: dict[str, subprocess.Popen] = {}
    dog = Watchdog(procs)
    try:
        for role in argv:  # the tail, the stages, the head
            procs[role] = spawn(argv[role], log_files[role])
        dog.start()
        r = connect(urls.producer)
        wait_for_tails(r, Keys(prefix), proc=procs["tail"], timeout_s=900)
        want = {f"{role}-{name} {a}:{b}" for role, (a, b) in zip(stage_args, itertools.pairwise(cuts), strict=True)}
        wait_for_stages(r, Keys(prefix), want, procs)
        client = Client(r, prefix=prefix, queue=prefix)
        # warm-up: one short job (not a measured prompt); the synthetic drafter needs references, so none there
        warm_kind = "none" if synthetic else cfg.kind
        warm = request([(i * 7 + 3) % model.vocab for i in range(16)], min(8, cfg.new), draft_dict(warm_kind, cfg.k))
        view = run_batch(client, [warm], 900, "warm-up").views[0]
        if view.status != "finished":
            raise click.ClickException(f"warm-up job {view.status}: {view.error}")
        say(f"variant {name}: workers ready")
        yield Workers(client, {role: procs[role] for role in roles}, log_files)
    except KeyboardInterrupt:
        if dog.died:
            raise click.ClickException(f"{dog.died} (see {logs})") from None
        raise
    finally:
        dog.done.set()
        stop_processes(list(procs.values()), 20.0)


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
