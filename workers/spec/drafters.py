"""Drafters behind one small interface: a draft model, or model-free n-gram prompt lookup.

A drafter makes one `DraftSession` per generation; `propose(context, k, sampling, gen)` returns up to
k tokens and, when sampling, the distribution q each was drawn from. A model session keeps its own KV
cache and re-syncs it to the committed context at every call: it crops to the longest prefix it holds
and feeds what is missing, so after a fully accepted round it consumes the last draft and the bonus
token before drafting again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from schemas.requests import SamplingParams
from workers.engine.runner import Engine
from workers.engine.shard import Shard
from workers.spec.sampling import warp


@dataclass
class Draft:
    tokens: list[int]
    q: torch.Tensor | None = None  # [k, V] draft probabilities (model drafter, sampling only)
    point: bool = False  # deterministic proposals: q(x) = 1


class DraftSession(Protocol):
    """One generation's drafter. The head's batcher drafts greedily for every session whose `model_session`
    is a ModelDraftSession in one batched call, then hands each its model draft through `finish`; other
    sessions `propose` on their own. `close` gives back what the session holds (a cache slot)."""

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

    def new_session(self) -> ModelDraftSession:
        return ModelDraftSession(self.engine)


class ModelDraftSession:
    def __init__(self, engine: Engine) -> None:
        self.engine, self.cache = engine, engine.acquire()
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

    @torch.inference_mode()
    def propose(self, context: list[int], k: int, sampling: SamplingParams, gen: torch.Generator) -> Draft:
        """Draft k tokens, feeding each back on the device; one host sync at the end (greedy: see
        `propose_greedy_many`)."""
        if k <= 0:
            return Draft([])
        if sampling.greedy:
            return propose_greedy_many([self], [context], [k])[0]
        feed, keep = self.plan(context)
        logits = self.engine.forward(self.cache, torch.tensor(feed, device=self.device), keep, logits_last=1)[-1]
        picked: list[torch.Tensor] = []
        qs: list[torch.Tensor] = []
        for i in range(k):
            probs = warp(logits[None], sampling)[0]
            tok = torch.multinomial(probs, 1, generator=gen)
            qs.append(probs)
            picked.append(tok)
            if i < k - 1:
                logits = self.engine.forward(self.cache, tok, len(context) + i, logits_last=1)[-1]
        tokens = torch.cat(picked).tolist() if picked else []
        self.tokens = list(context) + tokens[: max(k - 1, 0)]
        return Draft(tokens, torch.stack(qs) if qs else None)


def propose_greedy_many(sessions: list[ModelDraftSession], contexts: list[list[int]], ks: list[int]) -> list[Draft]:
    """Greedy drafts for several sessions of one draft model at once: with CUDA graphs, the whole draft as
    one graph replay (`Engine.draft_many`); otherwise one batched forward per draft position (rows whose
    k is reached drop out). One host sync at the end."""
    engine = sessions[0].engine
    plans = [s.plan(c) for s, c in zip(sessions, contexts, strict=True)]
    with torch.inference_mode():
        caches = [s.cache for s in sessions]
        drafts = engine.draft_many(caches, [f for f, _ in plans], [k for _, k in plans], ks)
        if drafts is None:
            drafts = _greedy_steps(engine, caches, plans, contexts, ks)
        rows = drafts.tolist()
    out = []
    for s, c, k, row in zip(sessions, contexts, ks, rows, strict=True):
        s.tokens = list(c) + row[: max(k - 1, 0)]
        out.append(Draft(row[:k]))
    return out


def _greedy_steps(
    engine: Engine, caches: list, plans: list[tuple[list[int], int]], contexts: list[list[int]], ks: list[int]
) -> torch.Tensor:
    feeds = [torch.tensor(f, device=engine.shard.device) for f, _ in plans]
    logits = engine.forward_many(caches, feeds, [k for _, k in plans], logits_last=1)
    cur = torch.stack([lg[-1] for lg in logits]).argmax(-1)
    drafts = cur.new_zeros((len(caches), max(ks)))
    drafts[:, 0] = cur
    live = list(range(len(caches)))
    for i in range(1, max(ks)):
        keep = [j for j, b in enumerate(live) if ks[b] > i]
        if len(keep) < len(live):
            cur, live = cur[keep], [live[j] for j in keep]
        starts = [len(contexts[b]) + i - 1 for b in live]
        logits = engine.forward_many([caches[b] for b in live], list(cur[:, None]), starts, logits_last=1)
        cur = torch.stack([lg[-1] for lg in logits]).argmax(-1)
        drafts[live, i] = cur
    return drafts


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
        ctx = torch.tensor(context)
        for n in range(min(self.ngram_max, len(context) - 1), self.ngram_min - 1, -1):
            windows = ctx[:-1].unfold(0, n, 1)  # every n-gram that has at least one token after it
            hits = (windows == ctx[-n:]).all(dim=1).nonzero()
            if hits.numel():
                start = int(hits[-1]) + n
                return Draft(context[start : start + k], point=True)
        return Draft([], point=True)
