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
from workers.engine.runner import Engine
from workers.engine.shard import Shard
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
    `propose` on their own. `close` gives back what the session holds (a cache slot)."""

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

    def new_session(self, need: int | None = None) -> ModelDraftSession:
        """A session whose cache holds up to `need` positions (None: the engine's full length)."""
        return ModelDraftSession(self.engine, need)


class ModelDraftSession:
    def __init__(self, engine: Engine, need: int | None = None) -> None:
        self.engine, self.cache = engine, engine.acquire(need=need)
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
        keep = 0
        limit = min(len(self.tokens), self.cache.length, len(context) - 1)
        while keep < limit and self.tokens[keep] == context[keep]:
            keep += 1
        self.cache.crop(keep)
        self.tokens = list(context)
        return context[keep:], keep

    def propose(self, context: list[int], k: int, sampling: SamplingParams, gen: torch.Generator) -> Draft:
        """Draft k tokens (greedy, or sampled from `gen`): a batch of one (`propose_many`)."""
        return propose_many([self], [context], [k], [sampling], [gen])[0]


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
        rows = _draft_steps(engine, [s.cache for s in sessions], plans, contexts, ks, pick)
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
            top = logits.argmax(-1)
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
    """Greedy drafts for several sessions of one draft model at once: with CUDA graphs, the whole draft as
    one graph replay per pool of slots (`Engine.draft_many`); otherwise one batched forward per draft
    position (rows whose k is reached drop out). One host sync per pool; `meanwhile` (host work: the head's
    loop takes replies) runs once, while the first replay is on the device."""
    engine = sessions[0].engine
    plans = [s.plan(c) for s, c in zip(sessions, contexts, strict=True)]
    rows: list[list[int]] = [[] for _ in sessions]
    with torch.inference_mode():
        caches = [s.cache for s in sessions]
        plans = _prefilled(engine, caches, plans)
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
                continue
            if meanwhile is not None:
                meanwhile()
                meanwhile = None
            for i, row in zip(idx, got.cpu().tolist(), strict=True):  # read before the next replay reuses it
                rows[i] = row
        if rest:
            stepped = _draft_steps(
                engine,
                [caches[i] for i in rest],
                [plans[i] for i in rest],
                [contexts[i] for i in rest],
                [ks[i] for i in rest],
                _argmax,
            )
            for i, row in zip(rest, stepped, strict=True):
                rows[i] = row
    out = []
    for s, c, k, row in zip(sessions, contexts, ks, rows, strict=True):
        s.tokens = list(c) + row[: max(k - 1, 0)]
        out.append(Draft(row[:k]))
    return out


def _prefilled(engine: Engine, caches: list, plans: list[tuple[list[int], int]]) -> list[tuple[list[int], int]]:
    """Plans whose feeds are longer than a graph step (a new session's prompt, a replay) prefilled up to their
    last token, in one batched forward: the whole draft then runs through the graph with the other rows, rather
    than every row of the batch drafting step by step (and capturing step graphs at first use)."""
    if not engine.static:  # no whole-draft graph to join: the step path takes the feed whole
        return plans
    long = [i for i, (feed, _) in enumerate(plans) if len(feed) - 1 > engine.step_tokens]
    if not long:
        return plans
    feeds = [torch.tensor(plans[i][0][:-1], device=engine.shard.device) for i in long]
    engine.forward_many([caches[i] for i in long], feeds, [plans[i][1] for i in long], logits_last=0)
    out = list(plans)
    for i in long:
        feed, start = plans[i]
        out[i] = (feed[-1:], start + len(feed) - 1)
    return out


def _argmax(logits: torch.Tensor, live: list[int]) -> torch.Tensor:
    return logits.argmax(-1)


def _draft_steps(
    engine: Engine,
    caches: list,
    plans: list[tuple[list[int], int]],
    contexts: list[list[int]],
    ks: list[int],
    pick: Callable[[torch.Tensor, list[int]], torch.Tensor],
) -> list[list[int]]:
    """Drafts of max(ks) tokens per row: one batched forward per draft position, `pick(logits [live, V], live
    rows)` choosing each live row's token, fed back on the device; rows whose k is reached drop out. One host
    sync at the end."""
    feeds = [torch.tensor(f, device=engine.shard.device) for f, _ in plans]
    logits = engine.forward_many(caches, feeds, [k for _, k in plans], logits_last=1)
    live = list(range(len(caches)))
    cur = pick(torch.stack([lg[-1] for lg in logits]), live)
    steps = [(live, cur)]
    for i in range(1, max(ks)):
        keep = [j for j, b in enumerate(live) if ks[b] > i]
        if len(keep) < len(live):
            cur, live = cur[keep], [live[j] for j in keep]
        starts = [len(contexts[b]) + i - 1 for b in live]
        logits = engine.forward_many([caches[b] for b in live], list(cur[:, None]), starts, logits_last=1)
        cur = pick(torch.stack([lg[-1] for lg in logits]), live)
        steps.append((live, cur))
    flat = iter(torch.cat([c for _, c in steps]).tolist())
    rows: list[list[int]] = [[] for _ in caches]
    for rows_live, _ in steps:
        for b in rows_live:
            rows[b].append(next(flat))
    return rows


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
