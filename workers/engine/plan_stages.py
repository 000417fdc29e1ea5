"""The plan for N stages: a model's layers split between a head (the embedding, layers 0:a, the drafter), middle
stages (a range each) and a tail (the last range, the norm and the LM head), on GPUs of given sizes or on machines
of several GPUs each; every worker's memory as workers count theirs at start (`plan.Costs`, the accounting of
`check_worker` / `worker_needs`), and the predicted tok/s of one job. `shardflow plan` prints it
(producer/cli_plan.py):

    shardflow plan --target Qwen/Qwen2.5-14B --draft Qwen/Qwen2.5-0.5B --dtype float16 --gpus 15GiB,15GiB,15GiB,15GiB
    shardflow plan ... --machines 15GiB+15GiB,15GiB+15GiB     # two machines of two GPUs each

    stages = plan_stages(config, [15 * GiB] * 4, dtype=torch.float16, draft=draft, timing=Timing(...))
    stages.chosen.workers     # head, stages, tail: layers, devices, each device's WorkerPlan

Layouts. `gpus` are GPUs of one machine each (a worker each); `machines` lists each machine's GPUs. The plan tries
the first m machines for every m, each machine either one worker spanning its GPUs (`--devices cuda:0,cuda:1`: no
Redis hop between them; each of its devices capped at the smallest one's size, as one --gpu-memory caps them) or
one worker per GPU, and keeps those of at least two workers. A spanning head keeps its drafter beside its first
layers (`--draft-device` = its first device).

Split. Over every device in route order, the layers go in contiguous ranges (cuts that part no Gemma 4 shared layer
from its source: `per_layer.plan_cuts`) that first maximise the jobs the layout holds in flight (the fewest slots of
any device, as `plan_split` does for two), then balance the devices' predicted compute (the most any one device
spends a round, its drafter's drafts included): a greedy cover that gives each device all the layers it may hold
under a slot floor and a time ceiling, the floor and the ceiling found by bisection (slots fall and time grows as a
range grows, so the greedy cover finds a split wherever one exists).

Prediction, for one job (a `Timing`): a round commits `tokens_per_round` tokens (E(K) of
workers/speculative/adaptive.py's `expected_tokens`, which the caller computes: workers.speculative imports this
package) and costs hops x rtt_ms (each worker one round trip through Redis: head -> stages -> tail -> head is N hops
for N workers) + each worker's compute (the bytes its layers read a round, the tail's norm and LM head included, at
bandwidth_gbs) + k draft steps (the drafter's weights each). Keys and values read are left out (small for one job).
Compute adds up along the route whatever the split, so for one job fewer workers are faster wherever they fit; more
hold more jobs in flight: the plan says both.
"""

from __future__ import annotations

import itertools
from bisect import bisect_right
from dataclasses import asdict, dataclass

import torch
from transformers import PretrainedConfig

from schemas.errors import ModelLoadError
from schemas.settings import Settings
from workers.engine.per_layer import plan_cuts
from workers.engine.plan import Costs, Piece, WorkerPlan

MAX_MACHINES = 8  # layouts: 2^machines of them per prefix


@dataclass(frozen=True)
class Timing:
    """What the prediction assumes: a hop's round trip (each worker 43 ms from Redis: 86), what a GPU reads a
    second (a T4: about 300 GB/s), the tokens a round commits (`expected_tokens(alpha, k)`; 1 without a drafter),
    and the drafts a round (the drafter's steps)."""

    rtt_ms: float = 86.0
    bandwidth_gbs: float = 300.0
    tokens_per_round: float = 1.0
    k: int = 0

    def ms(self, nbytes: float) -> float:
        """Milliseconds to read `nbytes` at bandwidth_gbs."""
        return nbytes / (self.bandwidth_gbs * 1e6)


@dataclass(frozen=True)
class Seat:
    """One GPU of a layout: the worker it serves, its machine, its CUDA index there, its budget in bytes."""

    worker: int
    machine: int
    index: int
    budget: int


@dataclass
class Worker:
    """One worker of an N-stage plan: its role (head, stage, tail), layers, machine, CUDA devices and each
    device's memory, and what its layers (and a head's drafts) cost a round."""

    role: str
    layers: tuple[int, int]
    machine: int
    indices: list[int]
    devices: list[WorkerPlan]
    compute_ms: float

    @property
    def slots(self) -> int:
        return min(d.slots for d in self.devices)

    @property
    def budget(self) -> int:
        return min(d.budget for d in self.devices)

    def as_dict(self) -> dict:
        return {**asdict(self), "slots": self.slots, "devices": [d.as_dict() for d in self.devices]}


@dataclass
class StagePlan:
    """One layout's split and prediction: workers in route order (head first, tail last)."""

    model: str
    dtype: str
    quant: str
    full_len: int
    workers: list[Worker]
    timing: Timing
    draft_ms: float
    split: bool = True  # False: no split fits, the layers shown evenly

    @property
    def hops(self) -> int:
        return len(self.workers)

    @property
    def gpus(self) -> int:
        return sum(len(w.devices) for w in self.workers)

    @property
    def in_flight(self) -> int:
        return min(w.slots for w in self.workers)

    @property
    def fits(self) -> bool:
        return self.split and self.in_flight > 0

    @property
    def compute_ms(self) -> float:
        """Every worker's compute a round, the head's drafts included."""
        return sum(w.compute_ms for w in self.workers)

    @property
    def round_ms(self) -> float:
        return self.hops * self.timing.rtt_ms + self.compute_ms

    @property
    def tok_s(self) -> float:
        """Predicted tokens a second of one job."""
        return 1000.0 * self.timing.tokens_per_round / self.round_ms

    @property
    def shape(self) -> str:
        """GPUs per worker, e.g. "1+1+1+1" or "2+2"."""
        return "+".join(str(len(w.devices)) for w in self.workers)

    def as_dict(self) -> dict:
        head = {k: v for k, v in asdict(self).items() if k != "workers"}
        extra = {"hops": self.hops, "gpus": self.gpus, "in_flight": self.in_flight, "round_ms": self.round_ms}
        return {**head, **extra, "tok_s": self.tok_s, "workers": [w.as_dict() for w in self.workers]}


@dataclass
class Stages:
    """Every layout considered (fewest workers first), the one chosen, and what to tell the user."""

    options: list[StagePlan]
    chosen: StagePlan
    advice: str

    def as_dict(self) -> dict:
        return {
            "advice": self.advice,
            "chosen": self.chosen.as_dict(),
            "options": [
                {"workers": o.hops, "gpus": o.gpus, "shape": o.shape, "fits": o.fits, "in_flight": o.in_flight}
                | {"layers": [w.layers for w in o.workers], "round_ms": o.round_ms, "tok_s": o.tok_s}
                for o in self.options
            ],
        }


def layouts(machines: list[list[int]]) -> list[list[Seat]]:
    """Each way to run on the first m machines (every m): each machine one worker spanning its GPUs (each capped at
    the smallest's size) or one worker per GPU; those of at least two workers, fewest workers first."""
    out: list[list[Seat]] = []
    for m in range(1, len(machines) + 1):
        used = machines[:m]
        for spans in itertools.product((False, True), repeat=m):
            if any(span and len(gpus) == 1 for span, gpus in zip(spans, used, strict=True)):
                continue  # one GPU: spanning it is the same worker
            seats: list[Seat] = []
            for i, (span, gpus) in enumerate(zip(spans, used, strict=True)):
                first = seats[-1].worker + 1 if seats else 0
                for j, size in enumerate(gpus):
                    seats.append(Seat(first if span else first + j, i, j, min(gpus) if span else size))
            if seats[-1].worker >= 1:
                out.append(seats)
    return sorted(out, key=lambda s: (s[-1].worker, -len(s)))


class _Search:
    """The split of one layout's devices (see the module's docstring), with slot counts memoised across layouts by
    (kind, budget, layers)."""

    def __init__(self, costs: Costs, cuts: list[int], timing: Timing, draft_ms: float) -> None:
        self.costs, self.timing, self.draft_ms = costs, timing, draft_ms
        self.n = costs.shape.layers
        self.ends = sorted({*cuts, self.n})
        prefix = [0]
        for b in costs.shape.layer:
            prefix.append(prefix[-1] + b)
        self.prefix = prefix
        self.memo: dict[tuple[str, int, int, int], int] = {}

    def piece(self, kind: str, layers: tuple[int, int]) -> Piece:
        """A device's piece: the head's first (embedding and drafter), the tail's last (norm, LM head), or layers."""
        return self.costs.piece(layers, embed=kind == "head", head=kind == "tail", draft=kind == "head")

    def slots(self, kind: str, budget: int, a: int, b: int) -> int:
        key = (kind, budget, a, b)
        if key not in self.memo:
            self.memo[key] = self.costs.fit([(kind, budget, self.piece(kind, (a, b)))])[0].slots
        return self.memo[key]

    def ms(self, kind: str, a: int, b: int) -> float:
        """A device's compute a round: its layers' bytes read, the tail's norm and LM head, the head's drafts."""
        sh = self.costs.shape
        tail = sh.norm + sh.lm_head if kind == "tail" else 0
        return self.timing.ms(self.prefix[b] - self.prefix[a] + tail) + (self.draft_ms if kind == "head" else 0.0)

    def cover(self, kinds: list[str], budgets: list[int], floor: int, ceiling: float) -> list[int] | None:
        """Cuts (each device's last layer + 1) giving each device, in order, the most layers it holds with at least
        `floor` slots in at most `ceiling` ms, each at least one; None where they do not cover the model."""
        a, out, last = 0, [], len(kinds) - 1
        for d, (kind, budget) in enumerate(zip(kinds, budgets, strict=True)):
            if last - d >= len(self.ends):
                return None
            room = self.ends[-1 - (last - d)]  # a cut left for each device after this one (n the last's)
            ends = self.ends[bisect_right(self.ends, a) : bisect_right(self.ends, room)]
            if d == last:
                ends = ends[-1:] if ends and ends[-1] == self.n else []
            ok = [b for b in ends if self.ms(kind, a, b) <= ceiling]
            lo, hi = 0, len(ok)  # slots fall as the range grows: the longest with `floor`
            while lo < hi:
                mid = (lo + hi) // 2
                if self.slots(kind, budget, a, ok[mid]) >= floor:
                    lo = mid + 1
                else:
                    hi = mid
            if lo == 0:
                return None
            a = ok[lo - 1]
            out.append(a)
        return out

    def split(self, kinds: list[str], budgets: list[int]) -> list[int] | None:
        """The cuts: the most slots at the fewest devices' slots, then the least time on the busiest device."""
        inf = float("inf")
        if self.cover(kinds, budgets, 1, inf) is None:
            return None
        lo, hi = 1, self.costs.settings.engine.max_slots  # the floor: the most that still covers
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.cover(kinds, budgets, mid, inf) is not None else (lo, mid - 1)
        floor = lo
        low, high = 0.0, max(self.ms(k, 0, self.n) for k in kinds)  # the ceiling: the least that still covers
        for _ in range(40):
            mid = (low + high) / 2
            low, high = (low, mid) if self.cover(kinds, budgets, floor, mid) is not None else (mid, high)
        return self.cover(kinds, budgets, floor, high)

    def even(self, devices: int) -> list[int]:
        """Cuts of about even layers (what a layout that does not fit is shown with)."""
        at = [max(bisect_right(self.ends, round(self.n * (d + 1) / devices)) - 1, 0) for d in range(devices)]
        return [*(self.ends[i] for i in at[:-1]), self.n]


def _kinds(seats: list[Seat]) -> list[str]:
    last = len(seats) - 1
    return ["head" if i == 0 else "tail" if i == last else "layers" for i in range(len(seats))]


def plan_stages(
    config: PretrainedConfig,
    gpus: list[int] | None = None,
    *,
    dtype: torch.dtype,
    quant: str = "none",
    draft: PretrainedConfig | None = None,
    draft_quant: str = "none",
    settings: Settings | None = None,
    machines: list[list[int]] | None = None,
    timing: Timing | None = None,
    stages: int | None = None,
    min_jobs: int = 1,
    name: str = "",
) -> Stages:
    """Plan every layout of `gpus` (bytes, a machine each) or `machines` (each machine's GPUs), and choose the
    fastest for one job of those that hold `min_jobs` in flight (of `stages` workers, if given); ModelLoadError
    for layouts that cannot be (under two workers, over MAX_MACHINES machines)."""
    if (gpus is None) == (machines is None):
        raise ModelLoadError("a plan for N stages takes GPUs (a machine each) or machines: one of them")
    boxes = machines if machines is not None else [[g] for g in gpus or []]
    if not boxes or any(not box for box in boxes) or len(boxes) > MAX_MACHINES:
        raise ModelLoadError(f"give 1 to {MAX_MACHINES} machines, each with at least one GPU")
    if sum(map(len, boxes)) < 2:
        raise ModelLoadError("a plan needs at least 2 GPUs: a head and a tail")
    cfg, timing = settings or Settings(), timing or Timing()
    costs = Costs(config, dtype, quant, draft, draft_quant, cfg)
    n = costs.shape.layers
    dshape = costs.dshape
    dread = sum(dshape.layer) + dshape.norm + dshape.lm_head if dshape is not None else 0
    draft_ms = timing.k * timing.ms(dread)  # the drafter reads all its weights each step
    search = _Search(costs, plan_cuts(config), timing, draft_ms)
    options = []
    for seats in layouts(boxes):
        if len(seats) > n:  # a layer at least for each device
            continue
        kinds, budgets = _kinds(seats), [s.budget for s in seats]
        cuts = search.split(kinds, budgets)
        plan = _build(search, seats, kinds, cuts or search.even(len(seats)), name, dtype, quant, draft_ms)
        plan.split = cuts is not None
        options.append(plan)
    if stages is not None and not any(o.hops == stages for o in options):
        raise ModelLoadError(f"no layout of these GPUs has {stages} workers (each needs a GPU and a layer)")
    return _choose(options, stages, min_jobs)


def _build(
    search: _Search,
    seats: list[Seat],
    kinds: list[str],
    cuts: list[int],
    name: str,
    dtype: torch.dtype,
    quant: str,
    draft_ms: float,
) -> StagePlan:
    """The layout's workers: each device's piece, fitted together per worker (one slot count for its devices)."""
    starts = [0, *cuts[:-1]]
    count = seats[-1].worker + 1
    workers = []
    for w in range(count):
        mine = [i for i, s in enumerate(seats) if s.worker == w]
        role = "head" if w == 0 else "tail" if w == count - 1 else f"stage {w}"
        placed = [(role, seats[i].budget, search.piece(kinds[i], (starts[i], cuts[i]))) for i in mine]
        devices = search.costs.fit(placed)
        layers = (starts[mine[0]], cuts[mine[-1]])
        ms = sum(search.ms(kinds[i], starts[i], cuts[i]) for i in mine)
        workers.append(Worker(role, layers, seats[mine[0]].machine, [seats[i].index for i in mine], devices, ms))
    dt = str(dtype).removeprefix("torch.")
    return StagePlan(name, dt, quant, search.costs.full_len, workers, search.timing, draft_ms)


def _choose(options: list[StagePlan], stages: int | None, min_jobs: int) -> Stages:
    """The fastest for one job of those holding min_jobs (ties: more jobs in flight, fewer GPUs), or of `stages`
    workers if asked, and the advice: when fewer workers would be faster, or when memory needs them all."""
    ok = [o for o in options if o.fits and o.in_flight >= min_jobs]
    best = max(ok, key=lambda o: (o.tok_s, o.in_flight, -o.gpus)) if ok else None
    asked = [o for o in options if o.hops == stages]
    if asked:  # as asked; said when another would be faster
        mine = max(asked, key=lambda o: (o.fits, o.in_flight >= min_jobs, o.tok_s, o.in_flight, -o.gpus))
        if best is None or best.tok_s <= mine.tok_s:
            return Stages(options, mine, f"{_name(mine)}, as asked: {_fit(mine, min_jobs)}")
        return Stages(options, mine, f"{_against(best, mine)}; {mine.hops} as asked: {_fit(mine, min_jobs)}")
    every = max(options, key=lambda o: (o.hops, o.gpus))  # a worker a GPU: the most stages
    if best is None:
        short = "does not fit these GPUs" if not any(o.fits for o in options) else f"holds fewer than {min_jobs} jobs"
        return Stages(options, every, f"the model {short} in any layout (quantize, or add GPUs)")
    fewer = [o for o in options if o.hops < best.hops]
    if best is every and not fewer:
        return Stages(options, best, f"{_name(best)}: {_fit(best, min_jobs)}")
    if best is every and not any(o.fits for o in fewer):
        them = f"{best.hops - 1} of these GPUs" if all(o.gpus == o.hops for o in options) else "fewer workers"
        return Stages(options, best, f"{best.hops} stages needed: the model does not fit {them}")
    if best is every:
        return Stages(options, best, f"{best.hops} stages needed: fewer hold fewer than {min_jobs} jobs in flight")
    more = ""
    if every.fits and every.in_flight > best.in_flight:
        more = f" ({every.hops} hold {every.in_flight} jobs in flight against {best.in_flight}; --jobs sets the least)"
    return Stages(options, best, _against(best, every) + more)


def _name(o: StagePlan) -> str:
    """ "3 stages", or "2 stages (2+2 GPUs)" where a worker spans several."""
    return f"{o.hops} stages" + (f" ({o.shape} GPUs)" if o.gpus > o.hops else "")


def _fit(o: StagePlan, min_jobs: int) -> str:
    if not o.fits:
        return "the model does not fit them"
    held = f", fewer than the {min_jobs} asked" if o.in_flight < min_jobs else ""
    return f"{o.tok_s:.1f} tok/s predicted, {o.in_flight} jobs in flight{held}"


def _against(best: StagePlan, other: StagePlan) -> str:
    """ "3 stages predict 11.0 tok/s against 8.9 for 4: use 3"."""
    theirs = f"{other.tok_s:.1f} for {other.hops}" if other.fits else f"{other.hops}, which do not fit"
    return f"{_name(best)} predict {best.tok_s:.1f} tok/s against {theirs}: use {best.hops}"
