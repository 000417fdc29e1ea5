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
