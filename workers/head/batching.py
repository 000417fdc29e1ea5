"""Batching the head's compute across generations in flight.

The head's step loop (workers/head/loop.py) assembles a group of its ready generations (about live / G of them:
workers/head/groups.py) and hands their rounds to `Batcher.compute` under the runtime's lock, one group at a time;
each round (`HeadWork`, workers/head/drafts.py) is to draft up to k tokens, then run the lower shard over [uncached
committed tokens, drafts]. The group's drafts are made together (`draft_all`, workers/head/drafts.py) and the lower
shard runs once over every sequence's round, a greedy draft joining its ids on the device. While the device runs,
the loop's own work goes on: `compute` calls its `idle` once both are queued and again once the drafts are read, and
its `poll` while it waits for the device (`await_device`). The hidden states come back to the host in one copy, with
one check for non-finite rows on the device (`to_host_checked`); a sequence with such rows fails alone. If a batch
fails, each of its rounds is retried alone (its caches rolled back to where the round started, a sampled draft's
generator to its state as handed in), so one bad sequence fails only itself; an interrupt (a BaseException: a
shutdown, say) fails the whole batch and is raised on.
"""

from __future__ import annotations

import secrets
import time
from collections import Counter
from collections.abc import Callable
from functools import partial

import torch

from workers.engine.isolate import run_isolated
from workers.engine.numerics import non_finite_error
from workers.engine.runner import Engine
from workers.head.drafts import HeadWork, Wait, draft_all, model_session
from workers.head.groups import GroupPlan


def _k_free(w: HeadWork, engine: Engine) -> bool:
    """Whether w's round cost the same whatever its k: its rows ran through the lower shard's graphs (padded to
    K + 1) and its draft, if a model drafted it, through the whole-draft graph (the longest K for every row)."""
    if not engine.graphs:
        return False
    session = model_session(w)
    return session is None or (session.engine.graphs and w.sampling.greedy)


def await_device(done: torch.cuda.Event, poll: Callable[[], None] | None = None) -> None:
    """Until the device has passed `done`. With `poll` the thread does not block in one sync: it asks the device
    and, while it is not there, calls `poll()`, which takes what came meanwhile (the head's loop: replies),
    waiting a short while for it."""
    if poll is not None:
        while not done.query():
            poll()
    done.synchronize()


def to_host_checked(hidden: list[torch.Tensor], wait: Wait | None = None) -> tuple[list[torch.Tensor], list[bool]]:
    """The batch's hidden states on the host (copied out before the lock goes: the next batch replays the same
    graphs) and, per sequence, whether all are finite: one reduction over every row on the device, read back
    with the copy (one wait for both: `wait`, or a blocking sync), never a check per sequence on the host copy."""
    sizes = [h.shape[0] for h in hidden]
    rows = torch.cat(hidden)
    ok_rows = torch.isfinite(rows).all(dim=-1)
    if rows.is_cuda:  # into pinned host memory (torch caches its blocks): a pageable copy ran at ~3 GB/s
        host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
        ok_host = torch.empty(ok_rows.shape, dtype=ok_rows.dtype, pin_memory=True)
        host.copy_(rows, non_blocking=True)
        ok_host.copy_(ok_rows, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(rows.device))  # the rows' GPU, not the thread's current one
        (wait or torch.cuda.Event.synchronize)(done)
        rows, ok_rows = host, ok_host
    bounds = torch.tensor([0, *sizes]).cumsum(0)
    bad = torch.cumsum(~ok_rows, 0)  # non-finite rows up to each row: a sequence's count is a difference
    bad = torch.cat([torch.zeros(1, dtype=bad.dtype), bad])
    finite = (bad[bounds[1:]] == bad[bounds[:-1]]).tolist()
    return list(rows.split(sizes)), finite


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
    shard's). The loop holds the runtime's lock around each `compute`.

    It also keeps what the loop sizes and paces its groups by: `plan` (`GroupPlan`: how many groups the
    generations in flight split into, from the batch times and round waits noted to it) and `linger_s` (a CPU
    head's linger: how long the loop may wait for a group's worth of ready rounds before it computes fewer; on a
    CPU a batched forward costs little more than one sequence's, so generations that fell out of step cost more
    than one wait that puts them back in step). `batches` and `rounds` count the batches computed and the rounds
    in them: how well rounds batch."""

    def __init__(self, engine: Engine, plan: GroupPlan | None = None, linger_s: float = 0.0) -> None:
        self.engine, self.linger_s = engine, linger_s
        self.plan = plan or GroupPlan()
        self.batches = self.rounds = 0  # counters: how well rounds batch
        self._idle: Callable[[], None] | None = None  # `compute`'s caller's work while the device runs
        self._wait: Wait | None = None  # how `compute`'s waits for the device take the caller's work meanwhile

    def compute(
        self, batch: list[HeadWork], idle: Callable[[], None] | None = None, poll: Callable[[], None] | None = None
    ) -> None:
        """Compute a batch the caller assembled (the head's step loop, holding the runtime's lock): every
        item's draft and hidden states, or its error. `idle`, if given, is called twice while the device runs the
        batch: once the draft and the lower shard are both queued (a whole greedy draft is not read back before
        the lower shard is queued behind it), and again once the drafts are read, before the batch's last wait
        (the loop takes the replies that came meanwhile, and makes the rounds' headers). `poll`, if given, is
        called over and over while the batch waits for the device (`await_device`): the loop takes each reply as
        it comes, rather than after the wait."""
        self._idle = idle
        self._wait = partial(await_device, poll=poll) if poll is not None else None
        try:
            self._compute(batch)
        finally:
            self._idle = self._wait = None

    def _compute(self, batch: list[HeadWork]) -> None:
        """The batch as one forward; if that fails, each item alone (`run_isolated`): only an item that
        fails alone gets the error."""
        try:
            run_isolated(batch, self._compute_batch, _rewind, _fail)
        except BaseException as e:  # interrupts and shutdowns: fail the batch and pass it on
            for w in batch:
                w.error = w.error or e
            raise

    def _compute_batch(self, batch: list[HeadWork]) -> list[None]:
        t0 = time.perf_counter()
        drafted = draft_all(batch)
        dev = self.engine.shard.device
        with torch.inference_mode():
            flat, sizes = drafted.ids(batch, dev)  # one copy; a draft still on the device joins there
            hidden = self.engine.forward_many(
                [w.cache for w in batch], list(flat.split(sizes)), [w.start for w in batch]
            )
            if self._idle is not None:  # the draft and the lower shard are queued on the device: host work overlaps
                self._idle()
            drafts = drafted.read(self._wait)  # waits for the draft alone (the lower shard runs behind it)
            t1 = time.perf_counter()
            batch_id, routes = secrets.token_hex(8), Counter(w.route for w in batch)
            for w, d in zip(batch, drafts, strict=True):  # all a round's header needs, before its hidden states
                w.draft, w.tag, w.batch, w.hidden = d, (batch_id, routes[w.route]), len(batch), None
            if self._idle is not None:
                self._idle()
            hidden, finite = to_host_checked(hidden, self._wait)
        t2 = time.perf_counter()
        self.batches, self.rounds = self.batches + 1, self.rounds + len(batch)
        for w, h in zip(batch, hidden, strict=True):
            w.hidden, w.draft_s, w.head_s = h, t1 - t0, t2 - t1
            w.k_free = _k_free(w, self.engine)
        for w, ok in zip(batch, finite, strict=True):
            if not ok:  # fails this generation (the loop fails it), never sent as a packet
                w.error = non_finite_error("hidden states", self.engine.shard.layer_range, self.engine.shard.dtype)
        return [None] * len(batch)
