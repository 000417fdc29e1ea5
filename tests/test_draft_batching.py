"""Every drafter batches (workers/speculative/drafters.py, wired in workers/head/drafts.py): no Redis, no subprocess.

Sampled draft-model drafts of several generations advance together (one batched draft-model forward per draft
position, greedy rows alongside), each row drawing from its own generator exactly what it draws alone, so a
sequence's drafts and q never depend on what it is batched with; n-gram proposals of a batch run in one call and
equal the one-by-one lookup. The fixtures are tests/test_batcher.py's (tiny models, a spied engine).
"""

# ruff: noqa: F811  (the fixtures imported from the harness are redefined as test parameters, as pytest does)

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import workers.head.drafts as drafts_module
from schemas.requests import SamplingParams
from tests.test_batcher import (  # noqa: F401  (tiny is a fixture)
    CTX,
    GREEDY,
    SAMPLED,
    STATIC,
    Head,
    PlantedDrafter,
    Spec,
    Tiny,
    assert_same_round,
    compute_alone,
    spy,
    tiny,
)
from workers.head.drafts import HeadWork
from workers.speculative.drafters import Draft, ModelDraftSession, NgramDrafter, propose_many, propose_ngram_many
from workers.speculative.sampling import warp

WARPS = [  # three warps: rows of one warp are warped together, the others apart
    SamplingParams(temperature=1.0, seed=1),
    SamplingParams(temperature=0.7, top_k=20, seed=1),
    SamplingParams(temperature=1.3, top_p=0.9, seed=1),
]


@torch.inference_mode()
def draft_alone(
    session: ModelDraftSession, context: list[int], k: int, s: SamplingParams, gen: torch.Generator
) -> Draft:
    """The reference: a sampled draft proposed by itself, token by token (the pre-batching `propose`)."""
    if s.greedy:
        return session.propose(context, k, s, gen)
    feed, keep = session.plan(context)
    engine = session.engine
    logits = engine.forward(session.cache, torch.tensor(feed), keep, logits_last=1)[-1]
    picked, qs = [], []
    for i in range(k):
        probs = warp(logits[None], s)[0]
        tok = torch.multinomial(probs, 1, generator=gen)
        qs.append(probs)
        picked.append(tok)
        if i < k - 1:
            logits = engine.forward(session.cache, tok, len(context) + i, logits_last=1)[-1]
    tokens = torch.cat(picked).tolist()
    session.tokens = list(context) + tokens[: k - 1]
    return Draft(tokens, torch.stack(qs))


def assert_same_draft(got: Draft, want: Draft, static: bool) -> None:
    assert got.tokens == want.tokens
    assert (got.q is None) == (want.q is None)
    if got.q is not None and want.q is not None:
        if static:  # a batched (padded) matmul rounds differently by a few float32 ulps
            assert torch.allclose(got.q, want.q, rtol=1e-5, atol=1e-6)
        else:  # dynamic caches run each sequence's own forward: bit for bit
            assert torch.equal(got.q, want.q)


@STATIC
def test_sampled_drafts_batch_and_equal_each_drafting_alone(tiny: Tiny, static: bool) -> None:
    """Five sampled sessions (three warps, k = 1..4) and a greedy one draft in one `propose_many`: one batched
    draft-model forward per position over the rows still drafting; over two rounds (re-synced after partial
    acceptance) each row's tokens, q, cache and generator state equal those of the same session drafting alone."""
    head, ref = Head(tiny, static), Head(tiny, static)
    contexts = [list(c) for c in (*CTX, CTX[0])]
    ks = [1, 4, 2, 3, 4, 3]
    samplings = [*WARPS, WARPS[0], GREEDY, WARPS[1]]
    sessions = [head.drafter.new_session() for _ in ks]
    alone = [ref.drafter.new_session() for _ in ks]
    for rnd in range(2):
        gens = [torch.Generator().manual_seed(100 * rnd + i) for i in range(len(ks))]
        ref_gens = [torch.Generator().manual_seed(100 * rnd + i) for i in range(len(ks))]
        calls = spy(head.drafter.engine, "forward_many")
        got = propose_many(sessions, contexts, ks, samplings, list(gens))
        assert [len(c.caches) for c in calls] == [sum(k > i for k in ks) for i in range(max(ks))]
        for i, (d, s) in enumerate(zip(got, samplings, strict=True)):
            want = draft_alone(alone[i], contexts[i], ks[i], s, ref_gens[i])
            assert_same_draft(d, want, static)
            assert len(d.tokens) == ks[i] and (d.q is None) == s.greedy
            if d.q is not None:
                assert d.q.shape == (ks[i], tiny.vocab) and torch.allclose(d.q.sum(-1), torch.ones(ks[i]))
            assert torch.equal(gens[i].get_state(), ref_gens[i].get_state())  # the same draws, no more
            assert sessions[i].tokens == alone[i].tokens
            assert sessions[i].cache.length == alone[i].cache.length == len(contexts[i]) + ks[i] - 1
        # the next round: some drafts accepted, then a bonus token
        contexts = [[*c, *d.tokens[: i % 3], 30 + i] for i, (c, d) in enumerate(zip(contexts, got, strict=True))]
    for s in (*sessions, *alone):
        s.close()


def test_k_zero_rows_draft_nothing_and_draw_nothing(tiny: Tiny) -> None:
    """A row that wants no draft gets an empty one, its session and generator untouched."""
    head = Head(tiny, False)
    sessions = [head.drafter.new_session() for _ in range(2)]
    gens = [torch.Generator().manual_seed(3) for _ in range(2)]
    before = gens[0].get_state()
    got = propose_many(sessions, [list(CTX[0]), list(CTX[1])], [0, 2], [SAMPLED, SAMPLED], list(gens))
    assert got[0] == Draft([]) and sessions[0].cache.length == 0
    assert torch.equal(gens[0].get_state(), before) and len(got[1].tokens) == 2


class DrawingPlanted(PlantedDrafter):
    """A plugin drafter whose `finish` draws from the round's generator after the inner model draft (as
    bench/synthetic.py's does): batched, the draws stay in the order they come alone."""

    def finish(self, draft: Draft, context: list[int], k: int, gen: torch.Generator | None) -> Draft:
        return Draft(torch.randint(0, 50, (k,), generator=gen).tolist(), point=True)


def make(head: Head, spec: Spec, sampling: SamplingParams) -> HeadWork:
    """A round of `spec` with the given sampling (a planted drafter's inner draft samples too)."""
    work = dataclasses.replace(head.work(spec), sampling=sampling)  # re-records the generator's state
    if spec.drafter == "drawing":
        work.drafter = DrawingPlanted([], head.drafter.new_session())
    return work


ROUNDS = [  # (spec, sampling): sampled rounds of three warps, a twin, greedy, plugin drafters, n-gram, none
    (Spec(CTX[0], "sampled", 3, seed=5), WARPS[0]),
    (Spec(CTX[0], "sampled", 3, seed=5), WARPS[0]),  # the same context and seed: the same draft
    (Spec(CTX[1], "sampled", 4, seed=6), WARPS[1]),
    (Spec(CTX[2], "sampled", 2, seed=7, first=True), WARPS[2]),
    (Spec(CTX[3], "model", 3), GREEDY),
    (Spec(CTX[4], "planted", 4, seed=8), SAMPLED),
    (Spec(CTX[2], "drawing", 2, seed=9), WARPS[2]),
    (Spec(CTX[2], "ngram", 3), SAMPLED),
    (Spec(CTX[1], "none", 0), SAMPLED),
]


@STATIC
def test_sampled_rounds_of_a_group_draft_in_one_batch(tiny: Tiny, static: bool) -> None:
    """Rounds of one group handed to `compute` draft their model sessions, sampled (three warps, plugin sessions
    around a model session) and greedy, in one `propose_many`: its first forward runs every model row, and there
    are as many forwards as the longest draft; each round equals the same round computed alone, and two rounds of
    one context and seed draft alike."""
    head, ref = Head(tiny, static), Head(tiny, static)
    works = [make(head, s, sampling) for s, sampling in ROUNDS]
    models = [w for w in works if w.drafter is not None and w.drafter.model_session is not None]
    calls = spy(head.drafter.engine, "forward_many")
    head.batcher.compute(works)
    assert len(models) == 7 and len(calls) == 4 and len(calls[0].caches) == 7
    assert [id(c) for c in calls[0].caches] == [id(w.drafter.model_session.cache) for w in models]  # type: ignore[union-attr]
    for (spec, sampling), w in zip(ROUNDS, works, strict=True):
        assert_same_round(w, compute_alone(ref.batcher, make(ref, spec, sampling)), static)
        if w.drafter is not None and w.drafter.model_session is not None:  # the inner model drafted, too
            assert w.drafter.model_session.cache.length == len(w.context) + w.k - 1
    twin, other = works[0].draft, works[1].draft
    assert twin is not None and other is not None and twin.q is not None and other.q is not None
    assert twin.tokens == other.tokens and torch.equal(twin.q, other.q)
    assert works[5].draft == Draft([1, 2, 3, 4], point=True)


def lookup_reference(context: list[int], k: int, ngram_max: int, ngram_min: int) -> list[int]:
    """The tensor lookup n-gram drafting used before it batched: each n, longest first."""
    ctx = torch.tensor(context)
    for n in range(min(ngram_max, len(context) - 1), ngram_min - 1, -1):
        windows = ctx[:-1].unfold(0, n, 1)
        hits = (windows == ctx[-n:]).all(dim=1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + n
            return context[start : start + k]
    return []


def test_ngram_batch_equals_one_by_one() -> None:
    """One `propose_ngram_many` over 200 contexts (vocabularies of 3 to 5000 tokens, 1 to 300 tokens, four
    (n_max, n_min) settings) equals each drafter's own `propose` and the tensor lookup, all point drafts."""
    rng = random.Random(13)
    settings = [(3, 1), (4, 2), (1, 1), (5, 5)]
    drafters = [NgramDrafter(*settings[i % 4]) for i in range(200)]
    contexts = [[rng.randrange(rng.choice((3, 20, 5000))) for _ in range(rng.randrange(1, 300))] for _ in range(200)]
    ks = [rng.randrange(1, 9) for _ in range(200)]
    got = propose_ngram_many(drafters, contexts, ks)
    gen = torch.Generator()
    for d, c, k, g in zip(drafters, contexts, ks, got, strict=True):
        assert g.point and g.q is None
        assert g.tokens == d.propose(c, k, SAMPLED, gen).tokens == lookup_reference(c, k, d.ngram_max, d.ngram_min)
    assert 50 < sum(bool(g.tokens) for g in got) < 200  # matches and misses
    # the latest occurrence of the longest n-gram wins; a match needs a token after it
    cases = [([1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3], 2, [5, 6]), ([5, 1, 7, 7, 1], 3, [7, 7, 1]), ([1, 2, 3], 3, [])]
    got = propose_ngram_many([NgramDrafter(3, 1)] * 4, [c for c, _, _ in cases] + [[4]], [k for _, k, _ in cases] + [3])
    assert [g.tokens for g in got] == [want for _, _, want in cases] + [[]]
    assert propose_ngram_many([], [], []) == []


def test_ngram_rounds_propose_in_one_call(tiny: Tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch's n-gram rounds (greedy and sampled) look up in one `propose_ngram_many`, never one by one, and
    each equals the same round alone."""
    head, ref = Head(tiny, False), Head(tiny, False)
    batched: list[int] = []

    def counted(drafters: list[NgramDrafter], contexts: list[list[int]], ks: list[int]) -> list[Draft]:
        batched.append(len(drafters))
        return propose_ngram_many(drafters, contexts, ks)

    specs = [Spec(c, "ngram", k) for c, k in zip(CTX, (2, 4, 3, 1, 2), strict=True)]
    samplings = [GREEDY, SAMPLED, GREEDY, SAMPLED, GREEDY]
    works = [make(head, s, sampling) for s, sampling in zip(specs, samplings, strict=True)]
    monkeypatch.setattr(drafts_module, "propose_ngram_many", counted)
    monkeypatch.setattr(NgramDrafter, "propose", lambda *a: pytest.fail("an n-gram round proposed alone"))
    head.batcher.compute(works)
    monkeypatch.undo()
    assert batched == [5]
    for spec, sampling, w in zip(specs, samplings, works, strict=True):
        assert_same_round(w, compute_alone(ref.batcher, make(ref, spec, sampling)), False)
    assert works[2].draft is not None and works[2].draft.tokens == [11, 12, 9]


@torch.inference_mode()
def test_a_prompt_batched_with_warm_rows_drafts_as_one_whole_draft(tiny: Tiny) -> None:
    """A new session's prompt in a batch of warm sessions (static caches): its feed is prefilled up to its last
    token in one forward, then every row drafts in the one `draft_many`, never step by step; the drafts equal
    each session's drafted alone."""
    from workers.speculative.drafters import propose_greedy_many

    head, ref = Head(tiny, True), Head(tiny, True)
    warm, fresh = [list(c) for c in CTX[:2]], list(CTX[2])
    sessions, alone = [head.drafter.new_session() for _ in range(3)], [ref.drafter.new_session() for _ in range(3)]
    for s, a, c in zip(sessions[:2], alone[:2], warm, strict=True):  # two sessions that drafted before (warm)
        propose_greedy_many([s], [c], [3])
        propose_greedy_many([a], [c], [3])
    warm = [[*c, 20 + i] for i, c in enumerate(warm)]  # each committed one more token since
    forwards, dmany = spy(head.drafter.engine, "forward_many"), spy(head.drafter.engine, "draft_many")
    got = propose_greedy_many(sessions, [*warm, fresh], [3, 3, 3])
    assert len(dmany) == 1 and len(dmany[0].caches) == 3  # the prompt joined the whole draft
    assert [len(c.caches) for c in forwards] == [1]  # its prefill, one forward; no draft steps
    want = [propose_greedy_many([a], [c], [3])[0] for a, c in zip(alone, [*warm, fresh], strict=True)]
    assert [d.tokens for d in got] == [d.tokens for d in want]


def test_drafts_left_on_the_device_join_the_lower_shards_ids():
    """`Drafted.ids` (workers/head/drafts.py): a draft read already, one still on the device (its row of a whole
    draft's output, its first k tokens) and no draft at all give each round's [pending, drafts], back to back."""
    from schemas.requests import SamplingParams
    from workers.head.drafts import Drafted, HeadWork
    from workers.speculative.drafters import GreedyLaunch

    def work(pending: list[int], k: int) -> HeadWork:
        return HeadWork(None, [1, *pending], k, SamplingParams(), None, None, pending, 1)  # type: ignore[arg-type]

    batch = [work([5], 2), work([6, 9], 2), work([3], 0), work([4], 3)]
    launch = GreedyLaunch([None, None], [[1], [1]], [2, 3])  # type: ignore[list-item]
    launch.add([0, 1], torch.tensor([[11, 12, 13, 14], [21, 22, 23, 24]]))
    drafted = Drafted(len(batch))
    drafted.host[0] = Draft([7, 8])
    drafted.device[1], drafted.device[3] = (launch, 0), (launch, 1)
    ids, sizes = drafted.ids(batch, torch.device("cpu"))
    assert sizes == [3, 4, 1, 4]
    assert ids.tolist() == [5, 7, 8, 6, 9, 11, 12, 3, 4, 21, 22, 23]


def _bare_loop(poll_ms: float):
    """A HeadLoop without its threads, models or Redis: what `_take_meanwhile` and `_poll` read."""
    import logging
    import threading

    from schemas.settings import Settings
    from workers.head.loop import HeadLoop, Inbox
    from workers.phases import PhaseClock

    loop = HeadLoop.__new__(HeadLoop)
    loop.settings = Settings(relay={"head_wait_poll_ms": poll_ms})
    loop._cv, loop._inbox, loop._aside = threading.Condition(), Inbox(), 0.0
    loop.clock = loop.relay_clock = PhaseClock("test", logging.getLogger("test"))
    taken: list[list] = []
    loop._take = taken.append  # type: ignore[method-assign]
    return loop, taken


def test_the_loops_poll_takes_each_reply_as_it_comes_until_the_device_is_done():
    """`HeadLoop._poll` asks whether the device is done (the group's drafts, or its `Launch`) and, while not, takes
    the replies that come (waiting at most `relay.head_wait_poll_ms` for one); with 0 it never waits (the batcher
    blocks)."""
    import threading
    import time

    loop, taken = _bare_loop(200.0)

    class Launch:
        def __init__(self, busy: int) -> None:
            self.busy, self.asked = busy, 0

        def ready(self) -> bool:
            self.asked += 1
            return self.asked > self.busy

    threading.Timer(0.02, loop._deliver, args=([("sid", b"1-1", {})],)).start()
    t0 = time.monotonic()
    loop._poll(Launch(busy=1).ready)
    assert taken == [[("sid", b"1-1", {})]] and time.monotonic() - t0 < 0.19
    loop.settings = loop.settings.replace(relay={"head_wait_poll_ms": 0.0})
    launch = Launch(busy=5)
    loop._poll(launch.ready)
    assert launch.asked == 0 and len(taken) == 1


def test_replies_taken_while_a_group_computes_leave_failed_sends_for_the_next_step():
    """While a group computes, the loop takes only replies: a failed send reported meanwhile (which may name the
    group's own generations, whose caches its queued forward still writes) waits in the inbox for the next step,
    as do submissions and cancels."""
    loop, taken = _bare_loop(1.0)
    err = RuntimeError("send failed")
    loop._send_failed(["a", "b"], err)
    loop._deliver([("a", b"1-1", {})])
    loop._take_meanwhile(0.0)
    assert taken == [[("a", b"1-1", {})]]
    assert loop._inbox.failed == [(["a", "b"], err)] and not loop._inbox.replies


@STATIC
def test_a_session_proposing_alone_still_records_its_inner_draft(tiny: Tiny, static: bool) -> None:
    """A drafter whose `finish` ignores its inner model draft (`proposes_alone`) gets its planted tokens, and its
    inner session's record of its cache still takes the draft the model wrote there, as a plain model session's
    does: unrecorded, every next round would feed the draft positions to the draft model again."""
    head, ref = Head(tiny, static), Head(tiny, static)
    works = [head.work(Spec(c, "alone", 4)) for c in CTX[:2]]  # a batch whose every model session proposes alone
    head.batcher.compute(works)
    for c, w in zip(CTX[:2], works, strict=True):
        want = ref.alone(Spec(c, "model", 4))
        assert w.draft == Draft([1, 2, 3, 4], point=True)
        assert want.draft is not None and len(want.draft.tokens) == 4
        inner = w.drafter.inner  # type: ignore[union-attr]
        assert inner.tokens == want.drafter.tokens == [*c, *want.draft.tokens[:3]]  # type: ignore[union-attr]


def test_a_wait_for_replies_while_the_device_runs_counts_as_the_groups_compute():
    """`_take_meanwhile`'s wait for a reply is the device's time: only handing replies out counts as the loop's own
    work (`_aside`, which the group plan's compute leaves out), so a group never looks cheaper than it ran."""
    loop, taken = _bare_loop(50.0)
    loop._take_meanwhile(0.05)  # nothing comes: 50 ms of waiting, none of it the loop's
    assert loop._aside == 0.0 and not taken
    loop._deliver([("a", b"1-1", {})])
    loop._take_meanwhile(0.05)
    assert taken and 0.0 < loop._aside < 0.04
