"""Adaptive draft length: choose K from measured acceptance and round timings.

Each draft is accepted with (estimated) probability alpha, independently, so a round with K drafts
commits (1 - alpha^(K+1)) / (1 - alpha) tokens on average; it costs the round's fixed time (head and
tail forwards, the network) plus K times the drafter's per-token time. `best_k` picks the K with the
most tokens per second; until a few rounds are measured, `DraftLength` follows transformers'
assisted-generation schedule (+2 after a fully accepted round, -1 otherwise), and when sampling it
always does, so that a fixed seed reproduces the same text (timings vary from run to run).

Where a round's compute does not depend on K at all (`free`: CUDA graphs draft the longest K for every row of a
batch, and pad every round's rows to K + 1), fewer drafts only lose tokens: the length stays at its most, unless
the link charges for them. Every draft goes on the wire as a hidden row (the head sends k + 1 rows, never the graphs'
padding), and on a link of finite bandwidth shared by N generations in flight each draft row of each of them adds
`wire_ms` = N row_bytes / bandwidth to every round (workers/head/link.py measures it). Then a greedy generation
weighs it from its first verdict on: K maximizes E(K) / (fixed + K (per_draft + wire_ms)), with `fixed` the
measured round time less its drafts' wire time. With N large the wire dominates and K falls (2 or 3 at 200 Mbit/s
for 256 bf16 7B sessions); as a batch drains N falls and K grows back. With no wire cost nothing changes.
"""

from __future__ import annotations

from dataclasses import dataclass


def expected_tokens(alpha: float, k: int) -> float:
    """Mean tokens a round with k drafts commits (accepted drafts + the correction/bonus token)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def best_k(alpha: float, fixed_ms: float, per_draft_ms: float, k_max: int) -> int:
    """The draft length in [1, k_max] with the most expected tokens per millisecond."""
    return max(range(1, k_max + 1), key=lambda k: expected_tokens(alpha, k) / max(fixed_ms + k * per_draft_ms, 1e-6))


@dataclass
class DraftLength:
    """Per-generation draft length: heuristic first, then the measured optimum."""

    k_max: int
    k: int = 0
    accepted: int = 0
    rejected: int = 0
    fixed_ms: float = 0.0
    per_draft_ms: float = 0.0
    rounds: int = 0
    warmup: int = 3
    smoothing: float = 0.3

    def __post_init__(self) -> None:
        self.k = self.k or self.k_max

    def update(
        self,
        drafted: int,
        accepted: int,
        draft_ms: float,
        other_ms: float,
        timed: bool = True,
        free: bool = False,
        wire_ms: float = 0.0,
    ) -> int:
        """Record one round (drafted > 0) and return the next round's draft length.

        timed=False keeps to the +2/-1 schedule, which depends only on acceptance: a seeded sampled
        generation then draws the same rounds, so the same seed gives the same text. free=True: the round's
        compute cost the same whatever its K; wire_ms: what each draft row costs the round on the link (see the
        module docstring). Free and no wire cost: the most."""
        self.rounds += 1
        self.accepted += accepted
        self.rejected += accepted < drafted
        w = self.smoothing if self.rounds > 1 else 1.0
        self.fixed_ms += w * (other_ms - drafted * wire_ms - self.fixed_ms)
        self.per_draft_ms += w * ((0.0 if free else draft_ms / drafted) - self.per_draft_ms)
        if timed and wire_ms > 0:  # the link charges for each draft: weighed from the first verdict on
            alpha = (self.accepted + 1) / (self.accepted + self.rejected + 2)
            self.k = best_k(alpha, max(self.fixed_ms, 0.0), self.per_draft_ms + wire_ms, self.k_max)
        elif free:
            self.k = self.k_max
        elif self.rounds < self.warmup or not timed:
            self.k = min(self.k + 2, self.k_max) if accepted == drafted else max(self.k - 1, 1)
        else:
            alpha = (self.accepted + 1) / (self.accepted + self.rejected + 2)  # Laplace-smoothed per-draft rate
            self.k = best_k(alpha, self.fixed_ms, self.per_draft_ms, self.k_max)
        return self.k


# --- the link model of `shardflow doctor`: what a link allows N sessions (pure functions, nothing measured here) ----
#
# One round of `sessions` generations with k drafts each moves rows = sessions (k + 1) hidden rows of `row_bytes`
# over a link of `bandwidth_Bps` (wire = rows row_bytes / bandwidth), computes for compute = compute_ms +
# rows row_ms (a fixed part, and a part that grows with the rows the batch runs) and waits one round trip. Run as one
# group, these add up:
#
#     round = rtt + compute + wire,    tok/s = sessions E(k) / round     (E: `expected_tokens`)
#
# which is `DraftLength`'s model: fixed + k (per_draft + wire_ms), with fixed = rtt + compute_ms + sessions row_ms +
# the k = 0 row's wire, per_draft = sessions row_ms and wire_ms = sessions row_bytes / bandwidth. Split into G groups
# (workers/head/groups.py) a group's compute and wire overlap the other groups' round trips, but the device and the
# wire are each one, shared: round = max(rtt + (compute + wire) / G, compute, wire). bandwidth None (or infinite):
# a link with no cap, wire = 0.


def round_ms(
    k: int,
    sessions: int,
    rtt_ms: float,
    compute_ms: float,
    row_bytes: float,
    bandwidth_Bps: float | None,
    *,
    row_ms: float = 0.0,
    groups: int = 1,
) -> float:
    """Milliseconds one round of every session takes on the link model above: with G = `groups` (at most
    `sessions`), round = max(rtt + (compute + wire) / G, compute, wire); G = 1: rtt + compute + wire."""
    rows = sessions * (k + 1)
    compute = compute_ms + rows * row_ms
    wire = 0.0 if not bandwidth_Bps or bandwidth_Bps == float("inf") else 1000.0 * rows * row_bytes / bandwidth_Bps
    g = max(1, min(groups, sessions))
    return max(rtt_ms + (compute + wire) / g, compute, wire)


def predict_rate(
    alpha: float,
    k: int,
    sessions: int,
    rtt_ms: float,
    compute_ms: float,
    row_bytes: float,
    bandwidth_Bps: float | None,
    *,
    row_ms: float = 0.0,
    groups: int = 1,
) -> float:
    """Committed tokens a second of `sessions` generations drafting `k` tokens a round, steady state:

        tok/s = sessions E(k) / (rtt + compute + sessions (k + 1) row_bytes / bandwidth)

    with E(k) = (1 - alpha^(k+1)) / (1 - alpha) (`expected_tokens`), times in seconds, compute = compute_ms +
    sessions (k + 1) row_ms; with `groups` > 1 the denominator is `round_ms`'s overlapped round. bandwidth_Bps:
    delivered bytes a second on the link the rows cross (None: no cap)."""
    t = round_ms(k, sessions, rtt_ms, compute_ms, row_bytes, bandwidth_Bps, row_ms=row_ms, groups=groups)
    return 1000.0 * sessions * expected_tokens(alpha, k) / max(t, 1e-9)


def link_k(
    alpha: float,
    sessions: int,
    rtt_ms: float,
    compute_ms: float,
    row_bytes: float,
    bandwidth_Bps: float | None,
    k_max: int,
    *,
    row_ms: float = 0.0,
    groups: int = 1,
) -> int:
    """The draft length in [1, k_max] with the most `predict_rate` (the shortest of equals). With groups = 1 it is
    `best_k(alpha, fixed, per_draft + wire, k_max)` with the terms of the model above, DraftLength's choice on a
    link it has measured; with no wire cost and row_ms = 0 it is k_max."""
    return max(
        range(1, max(k_max, 1) + 1),
        key=lambda k: predict_rate(
            alpha, k, sessions, rtt_ms, compute_ms, row_bytes, bandwidth_Bps, row_ms=row_ms, groups=groups
        ),
    )


def link_groups(
    k: int,
    sessions: int,
    rtt_ms: float,
    compute_ms: float,
    row_bytes: float,
    bandwidth_Bps: float | None,
    *,
    row_ms: float = 0.0,
    max_groups: int = 4,
    gain: float = 0.95,
) -> int:
    """Groups for `sessions` in flight as workers/head/groups.py picks them, on the model's round (`round_ms`): a
    larger G only where its round is shorter than `gain` times the best so far. Optimistic as GroupPlan's first
    guess is: compute splits evenly between groups (a smaller batch uses the device less well)."""
    best, best_t = 1, round_ms(k, sessions, rtt_ms, compute_ms, row_bytes, bandwidth_Bps, row_ms=row_ms)
    for g in range(2, min(max_groups, sessions) + 1):
        t = round_ms(k, sessions, rtt_ms, compute_ms, row_bytes, bandwidth_Bps, row_ms=row_ms, groups=g)
        if t < gain * best_t:
            best, best_t = g, t
    return best


def bytes_per_token(alpha: float, k: int, row_bytes: float) -> float:
    """Bytes on the wire per committed token: a round's k + 1 rows over the E(k) tokens it commits."""
    return (k + 1) * row_bytes / expected_tokens(alpha, k)


def batch_rate(
    alpha: float,
    k: int,
    jobs: int,
    new_tokens: int,
    prompt_tokens: int,
    rtt_ms: float,
    compute_ms: float,
    row_bytes: float,
    bandwidth_Bps: float | None,
    *,
    row_ms: float = 0.0,
    groups: int = 1,
) -> float:
    """Tokens a second over a whole batch of `jobs` generations of `new_tokens` each, all in flight at once: their
    prompts' rows cross the link once (jobs prompt_tokens row_bytes / bandwidth; their compute, a prefill, left out),
    then new_tokens / E(k) rounds of `round_ms` each. A batch ends with its slowest job, which this leaves out
    (measured runs come out below it)."""
    k = max(1, min(k, new_tokens - 1)) if new_tokens > 1 else 1
    rounds = new_tokens / expected_tokens(alpha, k)
    t = rounds * round_ms(k, jobs, rtt_ms, compute_ms, row_bytes, bandwidth_Bps, row_ms=row_ms, groups=groups)
    if bandwidth_Bps and bandwidth_Bps != float("inf"):
        t += 1000.0 * jobs * prompt_tokens * row_bytes / bandwidth_Bps
    return 1000.0 * jobs * new_tokens / max(t, 1e-9)
