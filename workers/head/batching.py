"""Batching the head's compute across generations in flight, as data the step loop holds while the device runs.

The head's step loop (workers/head/loop.py) assembles a group of its ready generations (about live / G of them:
workers/head/schedule.py) and computes it under the runtime's lock in three calls, doing its own work between them:

    launch = batcher.launch(works)   # every draft and the lower shard queued on the device
    launch.drafts_ready()            # whether the drafts are back (the loop takes replies until then)
    batcher.read_drafts(launch)      # the drafts read back (the lower shard still runs); its hidden states' copy queued
    launch.ready()                   # whether the device has passed that copy (the loop takes replies until then)
    batcher.collect(launch)          # the hidden states on the host, checked; a failed batch retried item by item

Each round (`HeadWork`, workers/head/drafts.py) is to draft up to k tokens, then run the lower shard over [uncached
committed tokens, drafts]. The group's drafts are made together (`draft_all`) and the lower shard runs once over
every sequence's round, a greedy draft joining its ids on the device. The hidden states come back to the host in one
copy, with one check for non-finite rows on the device (`HostCopy`); a sequence with such rows fails alone. If any
step of a batch fails, `collect` retries each of its rounds alone (its caches rolled back to where the round
started, a sampled draft's generator to its state as handed in), so one bad sequence fails only itself; an interrupt
(a BaseException: a shutdown, say) fails the whole batch and is raised on.
"""

from __future__ import annotations

import secrets
import time
from collections import Counter
from dataclasses import dataclass

import torch

from workers.engine.chain import WorkerEngine
from workers.engine.isolate import run_isolated
from workers.engine.numerics import non_finite_error
from workers.head.drafts import Drafted, HeadWork, draft_all, model_session
from workers.head.groups import GroupPlan


def _k_free(w: HeadWork, engine: WorkerEngine) -> bool:
    """Whether w's round cost the same whatever its k: its rows ran through the lower shard's graphs (padded to
    K + 1) and its draft, if a model drafted it, through the whole-draft graph (the longest K for every row)."""
    if not engine.graphs:
        return False
    session = model_session(w)
    return session is None or (session.engine.graphs and w.sampling.greedy)


@dataclass(eq=False)
class HostCopy:
    """A batch's hidden states on their way to the host: the copy and, per row, whether it is finite, queued on the
    device behind the batch (`done` recorded after them), so one wait reads both."""

    rows: torch.Tensor
    ok_rows: torch.Tensor
    sizes: list[int]
    done: torch.cuda.Event | None = None  # None: on the CPU, already there

    @classmethod
    def start(cls, hidden: list[torch.Tensor]) -> HostCopy:
        """Queue the copy (into pinned host memory: a pageable copy ran at ~3 GB/s), and one reduction over every
        row on the device for the finite check, never a check per sequence on the host copy."""
        sizes = [h.shape[0] for h in hidden]
        rows = torch.cat(hidden)
        ok_rows = torch.isfinite(rows).all(dim=-1)
        if not rows.is_cuda:
            return cls(rows, ok_rows, sizes)
        host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
        ok_host = torch.empty(ok_rows.shape, dtype=ok_rows.dtype, pin_memory=True)
        host.copy_(rows, non_blocking=True)
        ok_host.copy_(ok_rows, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(rows.device))  # the rows' GPU, not the thread's current one
        return cls(host, ok_host, sizes, done)

    def ready(self) -> bool:
        return self.done is None or self.done.query()

    def finish(self) -> tuple[list[torch.Tensor], list[bool]]:
        """Each sequence's hidden states on the host (copied out before the lock goes: the next batch replays the
        same graphs), and whether all its rows are finite."""
        if self.done is not None:
            self.done.synchronize()
        bounds = torch.tensor([0, *self.sizes]).cumsum(0)
        bad = torch.cumsum(~self.ok_rows, 0)  # non-finite rows up to each row: a sequence's count is a difference
        bad = torch.cat([torch.zeros(1, dtype=bad.dtype), bad])
        finite = (bad[bounds[1:]] == bad[bounds[:-1]]).tolist()
        return list(self.rows.split(self.sizes)), finite


def to_host_checked(hidden: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[bool]]:
    """The hidden states on the host and, per sequence, whether all are finite (`HostCopy`, waited for at once)."""
    return HostCopy.start(hidden).finish()


@dataclass(eq=False)
class Launch:
    """A group's compute as the device runs it: what `Batcher.launch` queued, then `read_drafts` added; the step loop
    holds it while it does its own work, and asks `ready`."""

    batch: list[HeadWork]
    t0: float
    drafted: Drafted | None = None
    hidden: list[torch.Tensor] | None = None  # on the device
    copy: HostCopy | None = None
    t1: float = 0.0  # when the drafts were read
    error: Exception | None = None  # a step failed: `collect` retries its rounds one by one

    def ready(self) -> bool:
        """Whether `collect` would not wait for the device (True once anything failed: the retry is synchronous)."""
        return self.error is not None or self.copy is None or self.copy.ready()

    def drafts_ready(self) -> bool:
        """Whether `Batcher.read_drafts` would not wait for the device."""
        return self.error is not None or self.drafted is None or self.drafted.ready()


def _rewind(w: HeadWork) -> None:
    """Back to the state the work was submitted in: the cache (a failed batched forward may have written
    part of it) and a sampled draft's generator (a retry drafts what the round drafts alone)."""
    if w.cache.length > w.start:
        w.cache.crop(w.start)
    if w.gen is not None and w.gen_state is not None:
        w.gen.set_state(w.gen_state)


def _fail(w: HeadWork, e: Exception) -> None:
    w.error = e


class Batcher:
    """Computes the groups of rounds the head's step loop assembles, one at a time, on one engine (the head
    shard's): `launch`, `read_drafts`, `collect` (the module docstring); `compute` does the three at once. The loop
    holds the runtime's lock from `launch` to `collect`.

    It also keeps what the loop sizes and paces its groups by: `plan` (`GroupPlan`: how many groups the
    generations in flight split into, from the batch times and round waits noted to it) and `linger_s` (a CPU
    head's linger, workers/head/schedule.py). `batches` and `rounds` count the batches computed and the rounds in
    them: how well rounds batch."""

    def __init__(self, engine: WorkerEngine, plan: GroupPlan | None = None, linger_s: float = 0.0) -> None:
        self.engine, self.linger_s = engine, linger_s
        self.plan = plan or GroupPlan()
        self.batches = self.rounds = 0  # counters: how well rounds batch

    def compute(self, batch: list[HeadWork]) -> None:
        """Every item's draft and hidden states, or its error, waiting for the device."""
        launch = self.launch(batch)
        self.read_drafts(launch)
        self.collect(launch)

    def launch(self, batch: list[HeadWork]) -> Launch:
        """Queue the group's drafts and its lower shard on the device (a whole greedy draft is not read back before
        the lower shard is queued behind it)."""
        launch = Launch(batch, time.perf_counter())
        try:
            launch.drafted = draft_all(batch)
            dev = self.engine.shard.device
            with torch.inference_mode():
                flat, sizes = launch.drafted.ids(batch, dev)  # one copy; a draft still on the device joins there
                caches, starts = [w.cache for w in batch], [w.start for w in batch]
                launch.hidden = self.engine.forward_many(caches, list(flat.split(sizes)), starts)
        except Exception as e:
            launch.error = e
        except BaseException as e:  # interrupts and shutdowns: fail the batch and pass it on
            self._fail_all(batch, e)
            raise
        return launch

    def read_drafts(self, launch: Launch) -> None:
        """Wait for the drafts alone (the lower shard runs behind them) and give each round all its header needs;
        queue the hidden states' copy to the host."""
        if launch.error is not None:
            return
        batch = launch.batch
        try:
            assert launch.drafted is not None and launch.hidden is not None
            with torch.inference_mode():
                drafts = launch.drafted.read()
                launch.t1 = time.perf_counter()
                batch_id, routes = secrets.token_hex(8), Counter(w.route for w in batch)
                for w, d in zip(batch, drafts, strict=True):
                    w.draft, w.tag, w.batch, w.hidden = d, (batch_id, routes[w.route]), len(batch), None
                launch.copy = HostCopy.start(launch.hidden)
        except Exception as e:
            launch.error = e
        except BaseException as e:
            self._fail_all(batch, e)
            raise

    def collect(self, launch: Launch) -> None:
        """The hidden states on the host, each round's or its error; if any step failed, each round alone
        (`run_isolated`): only an item that fails alone gets the error."""
        batch = launch.batch
        try:
            if launch.error is None:
                assert launch.copy is not None
                hidden, finite = launch.copy.finish()
                self._done(launch, hidden, finite, time.perf_counter())
                return
        except Exception as e:
            launch.error = e
        except BaseException as e:
            self._fail_all(batch, e)
            raise
        if len(batch) == 1:  # it failed alone already
            batch[0].error = launch.error
            return
        try:
            for w in batch:
                try:
                    _rewind(w)
                except Exception as e:  # its state cannot go back (a windowed layer's ring past its slack)
                    w.error = e
                    continue
                run_isolated([w], self._alone, _rewind, _fail)
        except BaseException as e:
            self._fail_all(batch, e)
            raise

    def _alone(self, batch: list[HeadWork]) -> list[None]:
        """A batch computed synchronously, raising what fails it (a failed batch's retry, item by item)."""
        launch = self.launch(batch)
        if launch.error is None:
            self.read_drafts(launch)
        if launch.error is not None:
            raise launch.error
        assert launch.copy is not None
        self._done(launch, *launch.copy.finish(), time.perf_counter())
        return [None] * len(batch)

    def _done(self, launch: Launch, hidden: list[torch.Tensor], finite: list[bool], t2: float) -> None:
        batch = launch.batch
        self.batches, self.rounds = self.batches + 1, self.rounds + len(batch)
        for w, h, ok in zip(batch, hidden, finite, strict=True):
            w.hidden, w.draft_s, w.head_s = h, launch.t1 - launch.t0, t2 - launch.t1
            w.k_free = _k_free(w, self.engine)
            if not ok:  # fails this generation (the loop fails it), never sent as a packet
                w.error = non_finite_error("hidden states", self.engine.shard.layer_range, self.engine.shard.dtype)

    @staticmethod
    def _fail_all(batch: list[HeadWork], e: BaseException) -> None:
        for w in batch:
            w.error = w.error or e
