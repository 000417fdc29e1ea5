"""The tail's verification and stopping arithmetic on hand-built logits and probabilities: no model, no process.

`verify_greedy` / `verify_sampling` (workers/speculative/verify.py) and `cut_at_stops` / `StopStrings`
(workers/speculative/stopping.py), and the tail's batched verification (`BatchVerify`) against them round by round.
tests/test_sampling.py checks the whole split path's distribution with χ² through real processes; this file is the
fast unit layer under it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from typing import ClassVar

import pytest
import torch

from schemas.errors import PacketError
from schemas.requests import SamplingParams
from workers.speculative.sampling import decode_q, round_generator, warp
from workers.speculative.stopping import StopStrings, cut_at_stops
from workers.speculative.verify import verify_greedy, verify_sampling

V = 6  # vocabulary of the hand-built rows


def greedy_logits(targets: list[int], vocab: int = V) -> torch.Tensor:
    """Logits [len(targets), vocab] whose row i has its argmax at targets[i] (with distinct runner-ups)."""
    logits = torch.linspace(-1.0, 0.0, vocab).repeat(len(targets), 1)
    for i, t in enumerate(targets):
        logits[i, t] = 5.0
    return logits


def point(token: int, vocab: int = V) -> torch.Tensor:
    """A distribution with all its mass on `token`."""
    return torch.nn.functional.one_hot(torch.tensor(token), vocab).float()


def probs(*values: float) -> torch.Tensor:
    """A probability row from its values (checked to sum to one)."""
    row = torch.tensor(values, dtype=torch.float32)
    assert math.isclose(float(row.sum()), 1.0, abs_tol=1e-6)
    return row


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def drafts(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long)


def within(count: int, n: int, p: float, sds: float = 4.5) -> bool:
    """True when `count` of `n` Bernoulli(p) draws lies within `sds` binomial standard errors of n·p."""
    return abs(count - n * p) <= sds * math.sqrt(n * p * (1 - p)) + 1e-9


# --- greedy -------------------------------------------------------------------------------------------------------


def test_greedy_accepts_exactly_the_matching_prefix():
    """Drafts are accepted up to the first one that differs from the argmax; the next token is that row's argmax,
    even when later drafts would match their rows again."""
    logits = greedy_logits([3, 1, 4, 2])
    assert verify_greedy(logits, [3, 1, 5]) == (2, 4)
    assert verify_greedy(logits, [3, 0, 4]) == (1, 1)  # the third draft matches its row, but the second broke the run


def test_greedy_all_accepted_takes_the_bonus_from_the_last_row():
    assert verify_greedy(greedy_logits([3, 1, 4, 2]), [3, 1, 4]) == (3, 2)


def test_greedy_none_accepted_takes_the_first_rows_argmax():
    assert verify_greedy(greedy_logits([3, 1, 4, 2]), [0, 1, 4]) == (0, 3)


def test_greedy_without_drafts_is_plain_decoding():
    assert verify_greedy(greedy_logits([5]), []) == (0, 5)


def test_greedy_ignores_the_logit_scale_and_takes_the_argmax():
    """Only the argmax counts: negative, shifted or scaled logits verify alike."""
    logits = greedy_logits([2, 0, 3])
    for transformed in (logits - 100.0, logits * 0.01, -1.0 / (logits - 10.0)):
        assert verify_greedy(transformed, [2, 0]) == (2, 3)


# --- rejection sampling: which drafts are accepted ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_cpu_greedy_pick_is_argmax_ties_and_nan_alike(dtype):
    from workers.engine.numerics import row_argmax

    gen = torch.Generator().manual_seed(0)
    for n in (7, 4096, 49152):
        rows = torch.randint(0, 4, (32, n), generator=gen).to(dtype)  # many equal greatest values a row
        rows[3, 5] = float("nan")
        assert torch.equal(row_argmax(rows), rows.argmax(dim=-1))


def test_sampling_accepts_every_draft_when_q_equals_p():
    """With q == p, u·q(x) < p(x) for every uniform u in [0, 1): every draft is accepted, the bonus comes from
    row k (here a point mass, so it is known)."""
    g = gen(0)
    for trial in range(200):
        rows = torch.rand(3, V, generator=g) + 0.01
        p = torch.cat([rows / rows.sum(-1, keepdim=True), point(trial % V)[None]])
        d = torch.multinomial(p[:3], 1, generator=g)[:, 0]
        assert verify_sampling(p, d, p[:3].clone(), gen(trial)) == (3, trial % V)


def test_sampling_rejects_a_draft_the_target_cannot_produce():
    """p(x) = 0 rejects draft x whatever q is; the replacement comes from norm(max(0, p - q)) of that row."""
    p = torch.stack([probs(0.0, 0.5, 0.5, 0.0, 0.0, 0.0), point(4)])
    q = probs(0.5, 0.5, 0.0, 0.0, 0.0, 0.0)[None]
    for seed in range(100):  # residual max(0, p - q) = [0, 0, .5, 0, 0, 0]: token 2 every time
        assert verify_sampling(p, drafts(0), q, gen(seed)) == (0, 2)


def test_rejection_replacement_follows_the_normalised_residual():
    """The replacement token is distributed as norm(max(0, p - q)): never the rejected draft, never a token
    where q covers p, and in the residual's proportions otherwise."""
    p = probs(0.0, 0.3, 0.3, 0.4, 0.0, 0.0)
    q = probs(0.4, 0.4, 0.1, 0.1, 0.0, 0.0)  # residual [0, 0, .2, .3, 0, 0] -> [0, 0, .4, .6, 0, 0]
    g, n = gen(7), 4000
    got = Counter()
    for _ in range(n):
        accepted, token = verify_sampling(torch.stack([p, point(5)]), drafts(0), q[None], g)
        assert accepted == 0  # p(0) = 0: always rejected
        got[token] += 1
    assert set(got) == {2, 3}
    assert within(got[2], n, 0.4)


def test_rejection_draws_from_the_rejected_row_not_the_next():
    """A rejection at position i replaces from row i's residual; rows after it are ignored."""
    p = torch.stack([point(1), point(3), point(4)])
    q = torch.stack([point(1), point(2)])  # draft 1 certain and right; draft 2 impossible under p
    for seed in range(50):
        assert verify_sampling(p, drafts(1, 2), q, gen(seed)) == (1, 3)


def test_all_accepted_draws_the_bonus_from_row_k():
    p = torch.stack([point(1), point(2), probs(0.0, 0.0, 0.0, 0.0, 0.5, 0.5)])
    q = torch.stack([point(1), point(2)])
    bonus = Counter(verify_sampling(p, drafts(1, 2), q, gen(seed)) for seed in range(200))
    assert set(bonus) == {(2, 4), (2, 5)}


def test_acceptance_probability_is_min_one_p_over_q():
    """One draft x: accepted with probability min(1, p(x)/q(x)) (here 0.25/0.5), and with certainty when p(x) ≥ q(x)."""
    p = torch.stack([probs(0.25, 0.75, 0.0, 0.0, 0.0, 0.0), point(5)])
    q = probs(0.5, 0.5, 0.0, 0.0, 0.0, 0.0)[None]
    g, n = gen(3), 4000
    accepted = sum(verify_sampling(p, drafts(0), q, g)[0] for _ in range(n))
    assert within(accepted, n, 0.5)
    assert all(verify_sampling(p, drafts(1), q, gen(s))[0] == 1 for s in range(100))  # p(1) = .75 ≥ q(1) = .5


def test_empty_residual_falls_back_to_the_rows_p():
    """When max(0, p - q) has no mass (p ≤ q everywhere: a p that rounding left short of q), the replacement is
    drawn from p itself, as the code documents."""
    p = torch.stack([torch.tensor([0.0, 0.5, 0.0, 0.0, 0.0, 0.0]), point(4)])  # p(0) = 0 < q(0): always rejected
    q = probs(0.5, 0.5, 0.0, 0.0, 0.0, 0.0)[None]
    for seed in range(50):
        assert verify_sampling(p, drafts(0), q, gen(seed)) == (0, 1)


# --- point q: deterministic drafters ------------------------------------------------------------------------------


def test_point_q_is_a_one_hot_of_each_draft():
    """A deterministic drafter's q travels as kind 'point': q(x) = 1 at its own draft and 0 elsewhere."""
    d = drafts(4, 0, 2)
    q = decode_q("point", d, {}, V)
    assert q is not None and q.shape == (3, V) and q.dtype == torch.float32
    assert torch.equal(q, torch.stack([point(4), point(0), point(2)]))
    assert decode_q("none", d, {}, V) is None


def test_point_q_accepts_with_probability_p_and_replaces_from_p_without_the_draft():
    """With q(x) = 1 the draft is accepted with probability p(x); on rejection the residual is p with x removed,
    renormalised, so x never comes back."""
    p0 = probs(0.2, 0.5, 0.3, 0.0, 0.0, 0.0)
    p = torch.stack([p0, point(5)])
    q = decode_q("point", drafts(1), {}, V)
    g, n = gen(11), 4000
    got = Counter(verify_sampling(p, drafts(1), q, g) for _ in range(n))
    assert set(got) <= {(1, 5), (0, 0), (0, 2)}
    assert within(got[(1, 5)], n, 0.5)
    rejected = got[(0, 0)] + got[(0, 2)]
    assert within(got[(0, 0)], rejected, 0.4)  # p without token 1, renormalised: [.4, 0, .6]


def test_point_q_on_an_impossible_draft_is_always_replaced_from_p():
    p = torch.stack([probs(0.0, 0.0, 0.0, 1.0, 0.0, 0.0), point(5)])
    q = decode_q("point", drafts(0), {}, V)
    assert all(verify_sampling(p, drafts(0), q, gen(s)) == (0, 3) for s in range(50))


# --- malformed input ----------------------------------------------------------------------------------------------


def test_a_draft_with_zero_probability_under_its_own_q_is_a_packet_error():
    """q(x) = 0 for a draft x means the packet's q was not what drafted it: rejected as malformed, at the first
    draft and at a later one reached after accepting the first."""
    half = probs(0.5, 0.5, 0.0, 0.0, 0.0, 0.0)
    with pytest.raises(PacketError, match="zero probability under its own q"):
        verify_sampling(torch.stack([half, half, point(0)]), drafts(2, 0), torch.stack([half, half]), gen())
    p = torch.stack([point(0), half, point(0)])  # the first draft (0) is certainly accepted
    with pytest.raises(PacketError, match="zero probability"):
        verify_sampling(p, drafts(0, 0), torch.stack([point(0), point(1)]), gen())


def test_sampled_drafts_without_q_are_a_packet_error():
    p = torch.stack([point(1), point(2)])
    with pytest.raises(PacketError, match="without their draft distribution"):
        verify_sampling(p, drafts(1), None, gen())


def test_no_drafts_samples_the_first_row():
    p = torch.stack([probs(0.0, 0.0, 0.5, 0.5, 0.0, 0.0), point(0)])
    got = Counter(verify_sampling(p, drafts(), None, gen(s)) for s in range(200))
    assert set(got) == {(0, 2), (0, 3)}
    assert verify_sampling(p[:1], drafts(), torch.zeros(0, V), gen()) == verify_sampling(p[:1], drafts(), None, gen())


# --- reproducibility ----------------------------------------------------------------------------------------------


def _rounds(g: torch.Generator, n: int = 60) -> list[tuple[int, int]]:
    """n verifications of one fixed 3-draft round with a partial-acceptance p/q pair, drawing from g."""
    h = torch.Generator().manual_seed(99)
    p = (torch.randn(4, V, generator=h) * 1.5).softmax(-1)
    q = (torch.randn(3, V, generator=h) * 1.5).softmax(-1)
    d = torch.multinomial(q, 1, generator=h)[:, 0]
    return [verify_sampling(p, d, q, g) for _ in range(n)]


def test_seeded_generators_reproduce_and_seeds_differ():
    assert _rounds(gen(5)) == _rounds(gen(5))
    assert _rounds(round_generator(3, 7, "verify")) == _rounds(round_generator(3, 7, "verify"))
    assert _rounds(gen(5)) != _rounds(gen(6))
    assert _rounds(round_generator(3, 7, "verify")) != _rounds(round_generator(3, 8, "verify"))


def test_verification_does_not_modify_its_inputs():
    h = torch.Generator().manual_seed(1)
    p = (torch.randn(3, V, generator=h)).softmax(-1)
    q = (torch.randn(2, V, generator=h)).softmax(-1)
    d = drafts(1, 2)
    before = (p.clone(), q.clone(), d.clone())
    for s in range(20):
        verify_sampling(p, d, q, gen(s))
    assert torch.equal(p, before[0]) and torch.equal(q, before[1]) and torch.equal(d, before[2])


# --- the committed token's exact distribution ---------------------------------------------------------------------

P3 = probs(0.2, 0.5, 0.3)
Q3 = probs(0.6, 0.3, 0.1)


def _first_tokens(make_draft: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]], draws: int) -> Counter:
    """The first committed token of `draws` one-draft rounds over a 3-token vocabulary with target P3."""
    g = gen(2024)
    p = torch.stack([P3, probs(1.0, 0.0, 0.0)])
    counts: Counter = Counter()
    for _ in range(draws):
        d, q = make_draft(g)
        accepted, nxt = verify_sampling(p, d, q, g)
        counts[int(d[0]) if accepted else nxt] += 1
    return counts


@pytest.mark.parametrize(
    ("drafter", "draws"),
    [
        pytest.param(lambda g: (torch.multinomial(Q3, 1, generator=g), Q3[None]), 20_000, id="sampled-from-q"),
        pytest.param(lambda g: (drafts(1), decode_q("point", drafts(1), {}, 3)), 5_000, id="point-on-1"),
        pytest.param(lambda g: (drafts(0), decode_q("point", drafts(0), {}, 3)), 5_000, id="point-on-0"),
    ],
)
def test_first_committed_token_is_distributed_as_p(drafter, draws):
    """k = 1, 3-token vocabulary, a fixed seed: each token's empirical frequency is within 4.5 standard errors
    of p, whether the draft is sampled from a q unlike p (20k draws) or is a deterministic proposal (point q)."""
    counts = _first_tokens(drafter, draws)
    assert sum(counts.values()) == draws
    for token, p in enumerate(P3.tolist()):
        assert within(counts[token], draws, p), (token, counts[token] / draws, p)


def test_warped_rows_verify_against_themselves():
    """Rows from the shared `warp` (top-k zeroes some tokens): drafts sampled from the warped q are never
    rejected when the target warps to the same distribution."""
    s = SamplingParams(temperature=0.8, top_k=3)
    h = torch.Generator().manual_seed(4)
    probs_ = warp(torch.randn(4, 50, generator=h) * 2, s)
    assert int((probs_[0] > 0).sum()) == 3
    for seed in range(50):
        g = gen(seed)
        d = torch.multinomial(probs_[:3], 1, generator=g)[:, 0]
        accepted, nxt = verify_sampling(probs_, d, probs_[:3], g)
        assert accepted == 3 and float(probs_[3, nxt]) > 0


# --- stopping -----------------------------------------------------------------------------------------------------


def test_cut_at_stops_keeps_the_first_eos():
    assert cut_at_stops([5, 7, 0, 8, 0], [0], 10) == ([5, 7, 0], "eos")
    assert cut_at_stops([5, 9, 7, 0], [0, 9], 10) == ([5, 9], "eos")  # any of several EOS ids
    assert cut_at_stops([0], [0], 1) == ([0], "eos")


def test_cut_at_stops_cuts_at_max_new():
    assert cut_at_stops([5, 6, 7, 8], [0], 2) == ([5, 6], "length")
    assert cut_at_stops([5, 6, 7], [0], 3) == ([5, 6, 7], "length")  # exactly max_new tokens: done
    assert cut_at_stops([5, 6, 0], [0], 2) == ([5, 6], "length")  # an EOS past the limit never counts


def test_cut_at_stops_prefers_eos_on_the_last_allowed_token():
    assert cut_at_stops([5, 0, 7], [0], 2) == ([5, 0], "eos")


def test_cut_at_stops_leaves_an_unfinished_round_alone():
    assert cut_at_stops([5, 6], [0], 3) == ([5, 6], None)
    assert cut_at_stops([5, 6], [], 3) == ([5, 6], None)  # no EOS ids (random-weight benchmark heads)
    assert cut_at_stops([5, 0, 6], [], 3) == ([5, 0, 6], "length")


class CharTokenizer:
    """A tokenizer stand-in: token i decodes to PIECES[i]; records what it was asked to decode."""

    PIECES: ClassVar[list[str]] = ["a", "b", "c", "EN", "D", "END", " ", "x"]

    def __init__(self) -> None:
        self.asked: list[list[int]] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        self.asked.append(list(ids))
        return "".join(self.PIECES[i] for i in ids)


def test_stop_strings_match_the_texts_end_even_across_tokens():
    tok = CharTokenizer()
    stops = StopStrings(tok, ["END"])
    assert stops.hit([0, 5])  # "aEND"
    assert stops.hit([0, 3, 4])  # "aEN" + "D": the stop begins inside an earlier token
    assert not stops.hit([0, 5, 7])  # "aENDx": the text must end with the stop (the round would have cut earlier)
    assert not stops.hit([0, 3])


def test_stop_strings_decode_only_a_short_window():
    tok = CharTokenizer()
    stops = StopStrings(tok, ["END", "ab"])
    ids = [0, 1, 2] * 100 + [3, 4]
    assert stops.hit(ids)
    assert len(tok.asked[-1]) == stops.window == len("END") + 4


def test_no_stop_strings_never_decode():
    tok = CharTokenizer()
    stops = StopStrings(tok, [])
    assert not stops.hit([3, 4]) and tok.asked == []
