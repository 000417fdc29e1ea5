"""Batched verification (workers/speculative/verify.py `BatchVerify`, through workers/tail/rounds.py): a whole
tail batch judged at once equals judging it round by round, and a bad round fails alone."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from schemas.errors import NonFiniteError
from schemas.packets import RoundPacket
from schemas.requests import SamplingParams
from workers.speculative.sampling import encode_q, warp
from workers.speculative.stopping import cut_at_stops
from workers.tail.rounds import Prepared, judge, plan_rounds

# --- a whole batch at once (workers/speculative/verify.py `BatchVerify`, through workers/tail/rounds.py) ---------

BV = 64  # vocabulary of the batched rounds


def random_round(rnd: random.Random, vocab: int = BV) -> tuple[Prepared, torch.Tensor]:
    """A random round and its logits: greedy or sampled (temperature, top-k, top-p, seed), 0-5 drafts that
    mostly match (greedy) or are drawn from a q near p (point, dense or sparse), sometimes a replay whose last
    token mostly is the first row's argmax, an EOS id and a max_new that may cut the round."""
    greedy, k, replay = rnd.random() < 0.5, rnd.randint(0, 5), rnd.random() < 0.3
    g = torch.Generator().manual_seed(rnd.randrange(1 << 30))
    logits = torch.randn(k + 1 + replay, vocab, generator=g) * 3
    kind, tensors = "none", {}
    if greedy:
        s = SamplingParams()
        best = logits.argmax(-1).tolist()
        ids = [best[replay + j] if rnd.random() < 0.7 else rnd.randrange(vocab) for j in range(k)]
    else:
        s = SamplingParams(
            temperature=rnd.choice([0.7, 1.0]),
            top_k=rnd.choice([0, 5]),
            top_p=rnd.choice([1.0, 0.9]),
            seed=rnd.choice([None, rnd.randrange(1000)]),
        )
        q = warp(logits[replay : replay + k] + torch.randn(k, vocab, generator=g), s)
        ids = torch.multinomial(q, 1, generator=g)[:, 0].tolist() if k else []
        if k:
            kind, tensors = ("point", {}) if rnd.random() < 0.3 else encode_q(q)
    last = int(logits[0].argmax()) if replay and rnd.random() < 0.8 else rnd.randrange(vocab)
    packet = RoundPacket.model_construct(
        session_id=f"s{rnd.randrange(1000)}",
        round_id=rnd.randrange(50),
        input_ids=[1, last],
        draft_ids=ids,
        sampling=s,
        q_kind=kind,
        replay=replay,
        eos_token_ids=[rnd.randrange(vocab)],
        max_new=rnd.randint(1, 7),
    )
    return Prepared(packet, None, b"", torch.zeros(0), tensors, {}), logits  # type: ignore[arg-type]


def seen(outcome) -> tuple:
    """An outcome as compared: (accepted, next) and the round's cut tokens, or the error's type and text."""
    if isinstance(outcome, BaseException):
        return type(outcome).__name__, str(outcome)
    return outcome


def round_by_round(batch: list[Prepared], logits: list[torch.Tensor]) -> list[tuple]:
    """What the tail gave before batched verification: each round's `judge`, after the finite check."""
    out = []
    for p, lg in zip(batch, logits, strict=True):
        try:
            if not bool(torch.isfinite(lg).all()):
                raise NonFiniteError("non-finite logits")
            out.append(judge(p, lg))
        except Exception as e:
            out.append(seen(e))
    return out


def batched(batch: list[Prepared], logits: list[torch.Tensor], warp_rows: int = 128) -> list[tuple]:
    return [seen(o) for o in plan_rounds(batch, torch.device("cpu"), warp_rows).run(logits)]


def cuts(batch: list[Prepared], outcomes: list[tuple]) -> list[tuple]:
    """The tokens each round commits (EOS and max_new cuts), as `TailWorker._verify` cuts them."""
    out = []
    for p, o in zip(batch, outcomes, strict=True):
        if isinstance(o[0], int):
            out.append(cut_at_stops(p.packet.draft_ids[: o[0]] + [o[1]], p.packet.eos_token_ids, p.packet.max_new))
    return out


@pytest.mark.parametrize("warp_rows", [1, 7, 128])
def test_batched_verification_equals_round_by_round(warp_rows):
    """Mixed batches of greedy and sampled rounds (every q kind, replays that pass and fail, sampling parameters
    that differ, seeds or none) in any order: the batch verifies every round as it verifies alone, token for token
    (each round keeps its own seeded generator), and so commits the same tokens after EOS and max_new cuts."""
    kinds = Counter()
    for seed in range(12):
        rnd = random.Random(seed)
        made = [random_round(rnd) for _ in range(rnd.randint(1, 30))]
        batch, logits = [p for p, _ in made], [lg for _, lg in made]
        want, got = round_by_round(batch, logits), batched(batch, logits, warp_rows)
        assert got == want, seed
        assert cuts(batch, got) == cuts(batch, want)
        for p, o in zip(batch, got, strict=True):
            kinds[p.packet.q_kind, p.packet.replay, o[0] if isinstance(o[0], str) else "ok"] += 1
    assert {("none", True, "SessionError"), ("sparse", False, "ok"), ("point", True, "ok")} <= set(kinds)


def test_a_non_finite_session_fails_alone():
    """NaN, +inf or -inf anywhere in one round's logits (greedy or sampled, replay row included) fails that round
    with the caller's non-finite error; every other round of the batch is verified as it would be alone."""
    rnd = random.Random(5)
    made = [random_round(rnd) for _ in range(12)]
    batch, logits = [p for p, _ in made], [lg.clone() for _, lg in made]
    poisoned = {1: float("nan"), 4: float("inf"), 8: float("-inf")}
    for i, value in poisoned.items():
        logits[i][-1, rnd.randrange(BV)] = value
    logits[10][0, 3] = float("nan")
    poisoned[10] = float("nan")
    assert {batch[i].packet.sampling.greedy for i in poisoned} == {True, False}
    marker = NonFiniteError("non-finite logits after layers 2:4 in float16")
    got = plan_rounds(batch, torch.device("cpu"), 128).run(logits, lambda: marker)
    want = round_by_round(batch, logits)
    for i, (o, w) in enumerate(zip(got, want, strict=True)):
        assert (o is marker) == (i in poisoned), i
        if i not in poisoned:
            assert seen(o) == w


def sampled_round(
    kind: str, tensors: dict, drafts: list[int], temperature: float = 1.0
) -> tuple[Prepared, torch.Tensor]:
    s = SamplingParams(temperature=temperature, seed=3)
    packet = RoundPacket.model_construct(
        session_id="s", round_id=1, input_ids=[1], draft_ids=drafts, sampling=s, q_kind=kind, replay=False
    )
    logits = torch.randn(len(drafts) + 1, BV, generator=torch.Generator().manual_seed(len(drafts)))
    return Prepared(packet, None, b"", torch.zeros(0), tensors, {}), logits  # type: ignore[arg-type]


def test_a_malformed_q_fails_only_its_round_and_as_alone():
    """A sparse q naming a token outside the vocabulary, a dense q of the wrong shape, a draft that its own q
    gives no mass: each fails its round with the error it gets alone, and the rest of the batch is verified."""
    q = (torch.randn(2, BV) * 2).softmax(-1)
    zero = q.clone()
    zero[0, 7] = 0.0
    bad = [
        sampled_round("sparse", {"q_idx": torch.tensor([[0, BV]] * 2, dtype=torch.int32), "q_val": q[:, :2]}, [0, 1]),
        sampled_round("dense", {"q": q[:, :-1]}, [3, 4]),
        sampled_round("dense", {"q": zero}, [7, 4]),
    ]
    rnd = random.Random(9)
    made = [random_round(rnd) for _ in range(6)] + bad
    batch, logits = [p for p, _ in made], [lg for _, lg in made]
    got, want = batched(batch, logits), round_by_round(batch, logits)
    assert got == want
    assert [o[0] for o in got[-3:]] == ["PacketError"] * 3


def test_probabilities_that_are_not_a_distribution_fail_their_round():
    """Finite logits that a tiny temperature turns into NaN probabilities fail their round (NonFiniteError) in
    the batch; alone, the multinomial refuses them (on a CUDA device, an assert would stop every session)."""
    rnd = random.Random(2)
    made = [random_round(rnd) for _ in range(5)] + [sampled_round("point", {}, [5, 6], temperature=1e-40)]
    batch, logits = [p for p, _ in made], [lg for _, lg in made]
    with pytest.raises(RuntimeError):
        judge(batch[-1], logits[-1])
    got = batched(batch, logits)
    assert got[-1][0] == "NonFiniteError"
    assert got[:-1] == round_by_round(batch[:-1], logits[:-1])


def test_a_greedy_batch_waits_for_the_device_once(monkeypatch):
    """Greedy rounds take one copy to the host for the whole batch (sampled rounds one more, for their tokens):
    no per-round .tolist(), .item(), int() or float() of a tensor."""
    rnd = random.Random(4)
    made = [random_round(rnd) for _ in range(20)]
    reads = Counter()
    for name in ("tolist", "item", "__int__", "__float__", "__bool__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor, name, lambda self, *a, _o=original, _n=name: reads.update([_n]) or _o(self, *a)
        )
    greedy = [(p, lg) for p, lg in made if p.packet.sampling.greedy]
    plan_rounds([p for p, _ in greedy], torch.device("cpu"), 128).run([lg for _, lg in greedy])
    assert reads == Counter(tolist=1)
    reads.clear()
    plan_rounds([p for p, _ in made], torch.device("cpu"), 128).run([lg for _, lg in made])
    assert reads == Counter(tolist=2)
