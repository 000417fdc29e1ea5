"""The head's round batching (workers/head/batching.py) on a real tiny model in-process: no Redis, no subprocess.

A group of rounds handed to `Batcher.compute` (as the head's step loop hands it each group it assembled) must run
as one batch (one lower-shard `forward_many` over the caches in the group's order, model drafts advancing
together; tests/test_draft_batching.py covers sampled and n-gram drafts) and each round must get exactly what it
gets alone; a failure fails only its own round (tests/test_batcher_failures.py). Each case runs over static
(pooled, batched) and dynamic (per-sequence) caches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from schemas.requests import SamplingParams
from schemas.settings import Settings
from workers.engine.kvcache import StaticKVCache
from workers.engine.runner import Engine
from workers.engine.shard import Cache, Shard, load_shard
from workers.head.batching import Batcher
from workers.head.drafts import HeadWork
from workers.speculative.drafters import Draft, DraftSession, ModelDrafter, NgramDrafter
from workers.tiny_models import build_tokenizer, save_tiny_model

GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=1.0, seed=1)
SPLIT = 2  # the head runs layers [0, 2) of the 4
K_MAX = 4  # the longest draft of these tests
MAX_LEN = 64
SLOTS = 4

# Token ids of committed contexts (the tiny tokenizer has a few hundred): repeats give the n-gram drafter matches.
CTX = [(5, 6, 7, 5, 6, 7, 5, 6), (40, 41, 42, 43, 44, 45), (9, 10, 11, 12, 9, 10, 11, 12, 9, 10), (100, 3, 100, 3, 100)]
CTX.append((70, 71, 72, 73, 74, 75, 76))
STATIC = pytest.mark.parametrize("static", [True, False], ids=["static", "dynamic"])


@dataclass(frozen=True)
class Tiny:
    """The head's lower shard and a draft model (the whole target) of one tiny checkpoint."""

    head: Shard
    draft: Shard

    @property
    def vocab(self) -> int:
        return int(self.head.config.vocab_size)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    torch.set_num_threads(1)
    path = save_tiny_model(tmp_path_factory.mktemp("batcher") / "qwen2", "qwen2", tokenizer=build_tokenizer())
    return Tiny(
        load_shard(path, (0, SPLIT), embed=True, head=False),
        load_shard(path, None, embed=True, head=True),
    )


@dataclass(frozen=True)
class Spec:
    """One generation's round: its committed context, drafter and draft length.

    drafter: "none", "ngram", "model" (greedy draft model), "sampled" (the draft model sampling), "planted"
    (a plugin-style drafter around an inner model session), "alone" (the same, saying `proposes_alone`), or
    "broken" (a drafter that raises).
    first: the generation's first round (the shard has seen nothing); otherwise all but the last token are cached.
    bad: the uncached token is outside the vocabulary (a bad input that fails the lower shard's forward)."""

    context: tuple[int, ...]
    drafter: str = "model"
    k: int = 3
    first: bool = False
    bad: bool = False
    seed: int = 0


class BrokenDrafter:
    """A draft session whose proposals fail."""

    device = torch.device("cpu")
    model_session = None

    def propose(self, context: list[int], k: int, sampling: SamplingParams, gen: torch.Generator) -> Draft:
        raise RuntimeError("drafter broke")

    def finish(self, draft: Draft, context: list[int], k: int, gen: torch.Generator | None) -> Draft:
        return draft

    def close(self) -> None:
        pass


class PlantedDrafter:
    """A plugin-style drafter (as bench/synthetic.py's) around a model session: the batcher drafts for the
    inner session with the others, then `finish` swaps in planted tokens."""

    device = torch.device("cpu")

    def __init__(self, planted: list[int], inner: DraftSession) -> None:
        self.planted, self.inner = planted, inner

    @property
    def model_session(self) -> Any:
        return self.inner

    def propose(self, context: list[int], k: int, sampling: SamplingParams, gen: torch.Generator) -> Draft:
        return self.finish(self.inner.propose(context, k, sampling, gen), context, k, gen)

    def finish(self, draft: Draft, context: list[int], k: int, gen: torch.Generator | None) -> Draft:
        return Draft(self.planted[:k], point=True)

    def close(self) -> None:
        self.inner.close()


class AlonePlantedDrafter(PlantedDrafter):
    """A planted drafter that says so (`proposes_alone`, as bench/synthetic.py's): the batcher need not read the
    inner draft before the lower shard is queued."""

    proposes_alone = True


@dataclass
class Call:
    """One call of a spied engine method: the caches it ran."""

    caches: list[Cache]


def spy(engine: Engine, name: str, before: Callable[[int], None] | None = None) -> list[Call]:
    """Record every call of `engine.<name>` (an instance attribute shadows the method); `before(n)` runs first."""
    calls: list[Call] = []
    inner = getattr(engine, name)

    def wrapper(caches: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(Call(list(caches)))
        if before is not None:
            before(len(calls))
        return inner(caches, *args, **kwargs)

    setattr(engine, name, wrapper)
    return calls


class Head:
    """What a head runtime holds for batching: the lower shard's engine, a draft model and a batcher."""

    def __init__(self, tiny: Tiny, static: bool, slots: int = SLOTS) -> None:
        self.tiny, self.static = tiny, static
        self.engine = Engine(
            tiny.head, Settings(engine={"static": static, "max_len": MAX_LEN}), step_tokens=K_MAX + 1, slots=slots
        )
        dengine = Engine(
            tiny.draft,
            Settings(engine={"static": static, "max_len": MAX_LEN}),
            step_tokens=2,
            pad=False,
            max_draft=K_MAX,
            slots=slots,
        )
        self.drafter = ModelDrafter(tiny.draft, dengine)
        self.batcher = Batcher(self.engine)

    def work(self, spec: Spec) -> HeadWork:
        """A round as `RoundLoop.next_work` makes it, the lower cache holding everything but the pending tokens."""
        ctx = list(spec.context)
        cache = self.engine.acquire()
        if spec.first:
            pending, start = ctx, 0
        else:
            with torch.inference_mode():
                self.engine.forward(cache, torch.tensor(ctx[:-1]), 0)
            pending, start = ctx[-1:], len(ctx) - 1
        if spec.bad:
            pending = [*pending[:-1], self.tiny.vocab + 5]
        sampling = SAMPLED if spec.drafter == "sampled" else GREEDY
        gen = torch.Generator().manual_seed(spec.seed) if spec.k > 0 else None
        return HeadWork(self.session(spec), ctx, spec.k, sampling, gen, cache, pending, start)

    def session(self, spec: Spec) -> Any:
        kind = spec.drafter
        if kind == "none":
            return None
        if kind == "ngram":
            return NgramDrafter()
        if kind == "broken":
            return BrokenDrafter()
        if kind in ("planted", "alone"):
            cls = AlonePlantedDrafter if kind == "alone" else PlantedDrafter
            return cls([1, 2, 3, 4, 5, 6, 7, 8], self.drafter.new_session())
        return self.drafter.new_session()

    def alone(self, spec: Spec) -> HeadWork:
        """The round computed by itself: a batch of one."""
        return compute_alone(self.batcher, self.work(spec))


def compute_alone(batcher: Batcher, work: HeadWork) -> HeadWork:
    """`work` computed as a batch of one; raises its error if it failed."""
    batcher.compute([work])
    if work.error is not None:
        raise work.error
    return work


def assert_same_round(got: HeadWork, want: HeadWork, static: bool) -> None:
    """`got` (computed in a batch) equals `want` (computed alone): drafts, their q, hidden states, cache length."""
    assert got.error is None
    assert got.draft is not None and want.draft is not None and got.hidden is not None and want.hidden is not None
    assert got.draft.tokens == want.draft.tokens
    assert got.draft.point == want.draft.point
    assert (got.draft.q is None) == (want.draft.q is None)
    if got.draft.q is not None:
        assert torch.allclose(got.draft.q, want.draft.q, rtol=1e-5, atol=1e-6)  # type: ignore[arg-type]
    assert got.hidden.dtype == torch.float32
    assert got.hidden.shape == (len(got.pending) + len(got.draft.tokens), got.hidden.shape[1])
    if static:  # a batched (padded) matmul rounds differently: a few float32 ulps of the largest activation
        scale = float(want.hidden.abs().max())
        assert torch.allclose(got.hidden, want.hidden, rtol=1e-5, atol=2e-6 * scale)
    else:  # dynamic caches run each sequence's own forward: bit for bit what it computes alone
        assert torch.equal(got.hidden, want.hidden)
    assert got.cache.length == want.cache.length == got.start + got.hidden.shape[0]


# --- one batch, exactly as alone ----------------------------------------------------------------------------------

MIXED = [
    Spec(CTX[0], "model", 3),
    Spec(CTX[2], "ngram", 4),
    Spec(CTX[1], "none", 0),
    Spec(CTX[3], "sampled", 2, seed=7),
    Spec(CTX[4], "model", 2, first=True),  # a first round: the whole prompt, longer than a step (runs eagerly)
    Spec(CTX[0], "planted", 4, seed=3),
]


@STATIC
def test_rounds_of_a_group_run_as_one_batch(tiny: Tiny, static: bool) -> None:
    """Six generations' rounds (greedy and sampled model drafts, n-gram, none, a first round, planted) handed to
    `compute` as one group run as one lower-shard forward over the caches in the group's order; each gets the
    drafts and hidden states it gets alone."""
    head, ref = Head(tiny, static), Head(tiny, static)
    works = [head.work(s) for s in MIXED]
    calls = spy(head.engine, "forward_many")
    head.batcher.compute(works)
    assert [w.error for w in works] == [None] * len(works)
    assert len(calls) == 1
    assert [id(c) for c in calls[0].caches] == [id(w.cache) for w in works]
    assert (head.batcher.batches, head.batcher.rounds) == (1, len(MIXED))
    assert len({(w.draft_s, w.head_s) for w in works}) == 1  # one batch: its stage times are every round's
    assert works[0].draft_s >= 0 and works[0].head_s > 0
    for spec, w in zip(MIXED, works, strict=True):
        assert_same_round(w, ref.alone(spec), static)
    assert works[1].draft is not None and works[1].draft.point and works[1].draft.tokens == [11, 12, 9, 10]
    assert works[2].draft == Draft([])
    assert works[3].draft is not None and works[3].draft.q is not None and works[3].draft.q.shape[0] == 2
    assert (ref.batcher.batches, ref.batcher.rounds) == (len(MIXED), len(MIXED))


@STATIC
def test_static_batch_runs_one_shard_pass(tiny: Tiny, static: bool) -> None:
    """With static caches the lower shard runs every step-sized round of a batch as one batched pass (`_batch`
    once over all of them); dynamic caches run each sequence's forward inside the same `forward_many` call."""
    head = Head(tiny, static)
    specs = [Spec(c, "model", k) for c, k in zip(CTX[:4], (3, 1, 4, 2), strict=True)]
    works = [head.work(s) for s in specs]
    batches = spy(head.engine, "_batch")
    forwards = spy(head.engine, "forward_many")
    head.batcher.compute(works)
    assert len(forwards) == 1
    if static:
        assert [len(c.caches) for c in batches] == [4]
        assert all(isinstance(c, StaticKVCache) for c in batches[0].caches)
    else:
        assert batches == []


def test_static_batch_beyond_the_pools_slots_stays_exact(tiny: Tiny) -> None:
    """More rounds than the static pool has slots: the extra sequences get one-slot pools of their own and still
    run inside the same batch, each exactly as alone."""
    head, ref = Head(tiny, True, slots=2), Head(tiny, True, slots=2)
    specs = [Spec(c, "ngram", 3) for c in CTX[:4]]
    works = [head.work(s) for s in specs]
    forwards, batches = spy(head.engine, "forward_many"), spy(head.engine, "_batch")
    head.batcher.compute(works)
    assert len(forwards) == 1
    assert sorted(len(c.caches) for c in batches) == [1, 1, 2]  # the pool's two slots, then two one-slot pools
    for spec, w in zip(specs, works, strict=True):
        assert_same_round(w, ref.alone(spec), True)


# --- draft-model drafts -------------------------------------------------------------------------------------------


@STATIC
def test_model_drafts_in_a_batch_equal_drafts_one_at_a_time(tiny: Tiny, static: bool) -> None:
    """Greedy drafts of one draft model for three generations (k = 1, 4, 2) advance together: one batched draft
    forward per draft position, rows dropping out when their k is reached (or, on a static cache, the whole draft
    as one `draft_many`, the prompts' feeds prefilled first up to their last token in one forward); over two
    rounds (all rejected, all accepted, some accepted) each generation's
    drafts and hidden states equal those of the same rounds run one at a time, and a fresh session's drafts."""
    head, ref = Head(tiny, static), Head(tiny, static)
    ks, accept = (1, 4, 2), (0, 4, 1)
    specs = [Spec(c, "model", k) for c, k in zip(CTX[:3], ks, strict=True)]
    works, alone = [head.work(s) for s in specs], [ref.work(s) for s in specs]
    for rnd in range(2):
        forwards = spy(head.engine, "forward_many")
        dforwards = spy(head.drafter.engine, "forward_many")
        dmany = spy(head.drafter.engine, "draft_many")
        head.batcher.compute(works)
        for w in alone:
            compute_alone(ref.batcher, w)
        for w, a in zip(works, alone, strict=True):
            assert_same_round(w, a, static)
            fresh = ref.drafter.new_session()
            try:
                assert w.draft is not None
                assert w.draft.tokens == fresh.propose(w.context, w.k, GREEDY, torch.Generator()).tokens
            finally:
                fresh.close()
        assert len(forwards) == 1
        if static:
            assert len(dmany) == 1 and len(dmany[0].caches) == 3
        warm = static and rnd == 1  # synced sessions feed at most 2 tokens each: the whole draft in one call
        assert [len(c.caches) for c in dforwards] == ([] if warm else [3] if static else [3, 2, 1, 1])
        # the next round as the round loop builds it: a accepted drafts and a bonus token committed
        nxt_works, nxt_alone = [], []
        for i, (w, a, acc) in enumerate(zip(works, alone, accept, strict=True)):
            for old, out in ((w, nxt_works), (a, nxt_alone)):
                assert old.draft is not None
                ctx = [*old.context, *old.draft.tokens[:acc], 20 + i]
                old.cache.crop(len(old.context) + acc)
                gen = torch.Generator().manual_seed(rnd + 1)
                out.append(HeadWork(old.drafter, ctx, old.k, GREEDY, gen, old.cache, ctx[-1:], len(ctx) - 1))
        works, alone = nxt_works, nxt_alone
