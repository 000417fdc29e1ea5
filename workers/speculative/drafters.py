"""Drafters behind one small interface: a draft model, or model-free n-gram prompt lookup.

A drafter makes one `DraftSession` per generation; `propose(context, k, sampling, gen)` returns up to
k tokens and, when sampling, the distribution q each was drawn from. A model session keeps its own KV
cache and re-syncs it to the committed context at every call: it crops to the longest prefix it holds
and feeds what is missing, so after a fully accepted round it consumes the last draft and the bonus
token before drafting again.

Several sessions draft at once: `propose_many` runs the model sessions of one draft model together (greedy
and sampled rows in one batched forward per position; each sampled row draws from its own generator exactly
what it draws alone), `propose_ngram_many` the n-gram ones. A session's `propose` is a batch of one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from schemas.requests import SamplingParams
from workers.engine.numerics import row_argmax
from workers.engine.runner import Engine
from workers.engine.shard import Shard
from workers.speculative.model_steps import argmax_pick, draft_steps, prefilled
from workers.speculative.sampling import warp


@dataclass
class Draft:
    tokens: list[int]
    q: torch.Tensor | None = None  # [k, V] draft probabilities (model drafter, sampling only)
    point: bool = False  # deterministic proposals: q(x) = 1


class DraftSession(Protocol):
    """One generation's drafter. The head's batcher drafts for every session whose `model_session` is a
    ModelDraftSession (greedy or sampled) in one batched call (`propose_many`), then hands each its model
    draft through `finish`; n-gram sessions propose together (`propose_ngram_many`); other sessions
    `propose` on their own. `close` gives back what the session holds (a cache slot). A session may say
    `proposes_alone = True`: its `finish` never reads the model draft it is handed (that draft only pays its
    cost), so a greedy batch's lower shard is queued behind the draft before the host reads it."""

    @property
    def device(self) -> torch.device: ...

    @property
    def model_session(self) -> ModelDraftSession | None: ...

    def propose(self, context: list[int], k: int, sampling: SamplingParams, gen: torch.Generator) -> Draft: ...

    def finish(self, draft: Draft, context: list[int], k: int, gen: torch.Generator | None) -> Draft: ...

    def close(self) -> None: ...


class Drafter(Protocol):
    name: str

    def new_session(self) -> DraftSession: ...


class ModelDrafter:
    """A full causal LM that shares the target's tokenizer, run with its own KV cache per session."""

    name = "model"

    def __init__(self, shard: Shard, engine: Engine | None = None, max_draft: int = 0) -> None:
        """`engine` runs the draft model (default: dynamic caches on CPU, static + graphs on CUDA, whole
        drafts of up to `max_draft` tokens as one graph)."""
        if shard.embed is None or shard.lm_head is None:
            raise ValueError("a draft model needs its embedding and LM head")
        self.shard = shard
        self.engine = engine or Engine(shard, step_tokens=2, pad=False, max_draft=max_draft)

    def new_session(self, need: int | None = None, overflow: bool = True) -> ModelDraftSession:
        """A session whose cache holds up to `need` positions (None: the engine's full length); NoFreeSlot where no
        free slot fits and not `overflow` (a spare one-slot pool)."""
        return ModelDraftSession(self.engine, need, overflow)


class NoFreeSlot(LookupError):
    """A draft model's pools have no free slot of the length asked (the head's loop seats the generation later)."""


class ModelDraftSession:
    def __init__(self, engine: Engine, need: int | None = None, overflow: bool = True) -> None:
        cache = engine.acquire(need=need, overflow=overflow)
        if cache is None:
            raise NoFreeSlot(f"no free draft slot of {need} positions")
        self.engine, self.cache = engine, cache
        self.tokens: list[int] = []  # what the cache holds

    def close(self) -> None:
        """Give the cache back to the engine (its captured graphs are reused by the next session)."""
        self.engine.release(self.cache)

    @property
    def device(self) -> torch.device:
        return self.engine.shard.device

    @property
    def model_session(self) -> ModelDraftSession:
        return self

    def finish(self, draft: Draft, context: list[int], k: int, gen: torch.Generator | None) -> Draft:
        return draft  # its own batched draft is the proposal

    def plan(self, context: list[int]) -> tuple[list[int], int]:
        """Crop the cache to the longest prefix of context[:-1] it holds; return (tokens to feed, start)."""
        keep = common_prefix(self.tokens, context, min(len(self.tokens), self.cache.length, len(context) - 1))
        self.cache.crop(keep)
        self.tokens = list(context)
        return context[keep:], keep

    def propose(self, context: list[int], k: int, sampling: SamplingParams, gen: torch.Generator) -> Draft:
        """Draft k tokens (greedy, or sampled from `gen`): a batch of one (`propose_many`)."""
        return propose_many([self], [context], [k], [sampling], [gen])[0]


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """The length of the longest common prefix of a and b, at most `limit`: slices compared in C, halving the span
    that holds the first difference (a round's context differs from the last only near its end; a token at a time in
    Python cost about 2 ms a draft of 128 sequences of 300 tokens)."""
    if a[:limit] == b[:limit]:
        return limit
    lo, hi = 0, limit  # a[:lo] == b[:lo]; a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def propose_many(
    sessions: list[ModelDraftSession],
    contexts: list[list[int]],
    ks: list[int],
    samplings: list[SamplingParams],
    gens: list[torch.Generator | None],
    *,
    meanwhile: Callable[[], None] | None = None,
) -> list[Draft]:
    """Drafts for several sessions of one draft model at once, each greedy or sampled (its own warp, its own
    generator, q returned). All greedy: `propose_greedy_many` (the whole draft as one graph replay where it
    applies; `meanwhile`, if given, is called while the device runs it, before its result is read). Otherwise
    one batched forward per draft position (rows whose k is reached drop out), greedy rows taking the argmax
    and each sampled row drawing one token per position from its own generator, exactly the draws it makes
    alone. Rows with k <= 0 get an empty draft and leave their session alone."""
    out = [Draft([]) for _ in sessions]
    rows = [i for i, k in enumerate(ks) if k > 0]
    if not rows:
        return out
    ss, cs, ns = [sessions[i] for i in rows], [contexts[i] for i in rows], [ks[i] for i in rows]
    if all(samplings[i].greedy for i in rows):
        got = propose_greedy_many(ss, cs, ns, meanwhile=meanwhile)
    else:
        got = _propose_mixed(ss, cs, ns, [samplings[i] for i in rows], [gens[i] for i in rows])
    for i, d in zip(rows, got, strict=True):
        out[i] = d
    return out


def _propose_mixed(
    sessions: list[ModelDraftSession],
    contexts: list[list[int]],
    ks: list[int],
    samplings: list[SamplingParams],
    gens: list[torch.Generator | None],
) -> list[Draft]:
    engine, pick = sessions[0].engine, _Sampler(samplings, gens)
    with torch.inference_mode():
        plans = [s.plan(c) for s, c in zip(sessions, contexts, strict=True)]
        rows = draft_steps(engine, [s.cache for s in sessions], plans, contexts, ks, pick)
        qs = [torch.stack(q) if q else None for q in pick.qs]
    out = []
    for s, c, k, row, q in zip(sessions, contexts, ks, rows, qs, strict=True):
        s.tokens = list(c) + row[: k - 1]
        out.append(Draft(row[:k], q))
    return out


class _Sampler:
    """Picks each live row's next draft token from its logits: the argmax for greedy rows; for sampled rows a
    draw from the warped distribution (rows of one warp warped together) with the row's own generator,
    keeping the distribution as the row's q."""

    def __init__(self, samplings: list[SamplingParams], gens: list[torch.Generator | None]) -> None:
        self.samplings, self.gens = samplings, gens
        self.qs: list[list[torch.Tensor]] = [[] for _ in samplings]

    def __call__(self, logits: torch.Tensor, live: list[int]) -> torch.Tensor:
        picked: list[torch.Tensor | None] = [None] * len(live)
        warps: dict[tuple[float, int, float], list[int]] = {}
        greedy = []
        for j, b in enumerate(live):
            s = self.samplings[b]
            if s.greedy:
                greedy.append(j)
            else:
                warps.setdefault((s.temperature, s.top_k, s.top_p), []).append(j)
        if greedy:
            top = row_argmax(logits)
            for j in greedy:
                picked[j] = top[j : j + 1]
        for js in warps.values():
            probs = warp(logits if len(js) == len(live) else logits[js], self.samplings[live[js[0]]])
            for j, p in zip(js, probs, strict=True):
                b = live[j]
                picked[j] = torch.multinomial(p, 1, generator=self.gens[b])
                self.qs[b].append(p)
        return torch.cat(picked)  # type: ignore[arg-type]


def propose_greedy_many(
    sessions: list[ModelDraftSession],
    contexts: list[list[int]],
    ks: list[int],
    *,
    meanwhile: Callable[[], None] | None = None,
) -> list[Draft]:
    """Greedy drafts for several sessions of one draft model at once (`launch_greedy_many`, then read);
    `meanwhile` (host work: the head's loop takes replies) runs while a whole-draft replay is on the device."""
    launch = launch_greedy_many(sessions, contexts, ks)
    if meanwhile is not None and launch.queued:
        meanwhile()
    return launch.drafts()


def launch_greedy_many(sessions: list[ModelDraftSession], contexts: list[list[int]], ks: list[int]) -> GreedyLaunch:
    """Queue greedy drafts for several sessions of one draft model: with CUDA graphs the whole draft as one graph
    replay per pool of slots (`Engine.draft_many`), not read back yet (`GreedyLaunch`); otherwise (and for feeds
    too long for the graph) one batched forward per draft position, read at once."""
    engine = sessions[0].engine
    launch = GreedyLaunch(sessions, contexts, ks)
    plans = [s.plan(c) for s, c in zip(sessions, contexts, strict=True)]
    with torch.inference_mode():
        caches = [s.cache for s in sessions]
        plans = prefilled(engine, caches, plans)
        by_pool: dict[int, list[int]] = {}  # one whole-draft graph per pool (short and full-length slots)
        rest = []
        for i, c in enumerate(caches):
            if len(plans[i][0]) > engine.step_tokens:  # a feed still too long for the graph: drafted by steps
                rest.append(i)
            else:
                by_pool.setdefault(id(getattr(c, "pool", None)), []).append(i)
        for idx in by_pool.values():
            got = engine.draft_many(
                [caches[i] for i in idx], [plans[i][0] for i in idx], [plans[i][1] for i in idx], [ks[i] for i in idx]
            )
            if got is None:
                rest += idx
            else:
                launch.add(idx, got)
        if rest:
            stepped = draft_steps(
                engine,
                [caches[i] for i in rest],
                [plans[i] for i in rest],
                [contexts[i] for i in rest],
                [ks[i] for i in rest],
                argmax_pick,
            )
            for i, row in zip(rest, stepped, strict=True):
                launch.rows[i] = row
    return launch


class GreedyLaunch:
    """Greedy drafts of several sessions, some still on the device (`launch_greedy_many`). `on_device(i)` is where
    session i's draft sits while it is not read: (a [rows, >= k] device tensor, its row), so the lower shard can
    be queued behind the draft without the host waiting for it; `drafts()` reads them (one wait, for the draft
    alone) and brings each session's record of its cache up to date."""

    def __init__(self, sessions: list[ModelDraftSession], contexts: list[list[int]], ks: list[int]) -> None:
        self.sessions, self.contexts, self.ks = sessions, contexts, ks
        self.rows: list[list[int] | None] = [None] * len(sessions)  # read already (drafted by steps)
        self.where: dict[int, tuple[torch.Tensor, int]] = {}
        self._reads: list[tuple[list[int], torch.Tensor, torch.cuda.Event | None]] = []
        self._drafts: list[Draft] | None = None

    @property
    def queued(self) -> bool:
        """Whether some draft is still on the device, unread."""
        return bool(self._reads) and self._drafts is None

    def ready(self) -> bool:
        """Whether `drafts()` would not wait for the device (every read's copy done)."""
        return all(done is None or done.query() for _, _, done in self._reads)

    def add(self, idx: list[int], got: torch.Tensor) -> None:
        """Drafts of sessions `idx` in `got` (a graph's output: copied, as the next replay reuses it)."""
        mine = got.clone()
        done = None
        if mine.is_cuda:  # into pinned host memory, queued now: read once the draft alone is done
            host = torch.empty(mine.shape, dtype=mine.dtype, pin_memory=True)
            host.copy_(mine, non_blocking=True)
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(mine.device))  # the draft's GPU, not the thread's current one
        else:
            host = mine
        self._reads.append((idx, host, done))
        for j, i in enumerate(idx):
            self.where[i] = (mine, j)

    def on_device(self, i: int) -> tuple[torch.Tensor, int] | None:
        return self.where.get(i) if self._drafts is None else None

    def known(self, i: int) -> Draft | None:
        """Session i's draft if it is on the host already (drafted by steps, or read), without waiting."""
        if self._drafts is not None:
            return self._drafts[i]
        row = self.rows[i]
        return Draft(row[: self.ks[i]]) if row is not None else None

    def drafts(self) -> list[Draft]:
        """Every session's draft (waiting for the device to pass each read's event)."""
        if self._drafts is None:
            for idx, host, done in self._reads:
                if done is not None:
                    done.synchronize()
                for i, row in zip(idx, host.tolist(), strict=True):
                    self.rows[i] = row
            out = []
            for s, c, k, row in zip(self.sessions, self.contexts, self.ks, self.rows, strict=True):
                row = row or []
                s.tokens = list(c) + row[: max(k - 1, 0)]
                out.append(Draft(row[:k]))
            self._drafts = out
        return self._drafts


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the context's last n-gram, copy what followed."""

    name = "ngram"

    def __init__(self, ngram_max: int = 3, ngram_min: int = 1) -> None:
        self.ngram_max, self.ngram_min = ngram_max, ngram_min

    device = torch.device("cpu")

    def new_session(self) -> NgramDrafter:
        return self

    model_session = None  # drafts by lookup, never in a model batch

    def finish(self, draft: Draft, context: list[int], k: int, gen: torch.Generator | None) -> Draft:
        return draft

    def close(self) -> None:
        """Holds nothing."""

    def propose(self, context: list[int], k: int, sampling: SamplingParams, gen: torch.Generator) -> Draft:
        return Draft(ngram_lookup(context, k, self.ngram_max, self.ngram_min), point=True)


def propose_ngram_many(drafters: list[NgramDrafter], contexts: list[list[int]], ks: list[int]) -> list[Draft]:
    """Each n-gram drafter's proposal for its context, in one call (plain Python: no tensors per sequence)."""
    return [
        Draft(ngram_lookup(c, k, d.ngram_max, d.ngram_min), point=True)
        for d, c, k in zip(drafters, contexts, ks, strict=True)
    ]


def ngram_lookup(context: list[int], k: int, ngram_max: int, ngram_min: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the context's longest matching last
    n-gram (n from min(ngram_max, len - 1) down to ngram_min; an occurrence needs a token after it).

    One scan back over the context: at each earlier occurrence of the last token (latest first), the length
    of the match ending there; the first occurrence with the longest match (capped at the largest n) wins."""
    size = len(context)
    top = min(ngram_max, size - 1)
    if top < ngram_min:
        return []
    rev = context[::-1]  # rev[i] is context[size - 1 - i]; an occurrence ending at i >= 1 has a token after it
    last, best, at, i = rev[0], 0, 0, 1
    while True:
        try:
            i = rev.index(last, i)
        except ValueError:
            break
        m = 1
        while m < top and i + m < size and rev[i + m] == rev[m]:
            m += 1
        if m > best:
            best, at = m, i
            if m == top:
                break
        i += 1
    if best < ngram_min:
        return []
    return context[size - at : size - at + k]
