"""Adaptive draft length: choose K from measured acceptance and round timings.

Each draft is accepted with (estimated) probability alpha, independently, so a round with K drafts
commits (1 - alpha^(K+1)) / (1 - alpha) tokens on average; it costs the round's fixed time (head and
tail forwards, the network) plus K times the drafter's per-token time. `best_k` picks the K with the
most tokens per second; until a few rounds are measured, `DraftLength` follows transformers'
assisted-generation schedule (+2 after a fully accepted round, -1 otherwise), and when sampling it
always does, so that a fixed seed reproduces the same text (timings vary from run to run).

Where a round's cost does not depend on K at all (`free`: CUDA graphs draft the longest K for every row of a
batch, and pad every round's rows to K + 1), fewer drafts only lose tokens: the length stays at its most.
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
        self, drafted: int, accepted: int, draft_ms: float, other_ms: float, timed: bool = True, free: bool = False
    ) -> int:
        """Record one round (drafted > 0) and return the next round's draft length.

        timed=False keeps to the +2/-1 schedule, which depends only on acceptance: a seeded sampled
        generation then draws the same rounds, so the same seed gives the same text. free=True: the round
        cost the same whatever its K (see the module docstring): the most."""
        self.rounds += 1
        self.accepted += accepted
        self.rejected += accepted < drafted
        if free:
            self.k = self.k_max
            return self.k
        w = self.smoothing if self.rounds > 1 else 1.0
        self.fixed_ms += w * (other_ms - self.fixed_ms)
        self.per_draft_ms += w * (draft_ms / drafted - self.per_draft_ms)
        if self.rounds < self.warmup or not timed:
            self.k = min(self.k + 2, self.k_max) if accepted == drafted else max(self.k - 1, 1)
        else:
            alpha = (self.accepted + 1) / (self.accepted + self.rejected + 2)  # Laplace-smoothed per-draft rate
            self.k = best_k(alpha, self.fixed_ms, self.per_draft_ms, self.k_max)
        return self.k
