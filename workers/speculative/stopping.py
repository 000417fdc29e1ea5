"""Exact stopping: EOS (also inside accepted drafts), max_new_tokens, and stop strings.

Stop strings follow transformers' StopStringCriteria: generation ends at the first token after which
the text ends with a stop string (which may begin inside an earlier token or the prompt); that token
is kept.
"""

from __future__ import annotations

from collections.abc import Sequence

from schemas.requests import FinishReason


def cut_at_stops(tokens: list[int], eos_ids: Sequence[int], max_new: int) -> tuple[list[int], FinishReason | None]:
    """Truncate a round's tokens at the first EOS (kept) or at max_new, whichever comes first."""
    eos = set(eos_ids)
    for i, t in enumerate(tokens[:max_new]):
        if t in eos:
            return tokens[: i + 1], "eos"
    if len(tokens) >= max_new:
        return tokens[:max_new], "length"
    return tokens, None


class StopStrings:
    """Detects stop strings as tokens commit, decoding only a short window of recent tokens."""

    def __init__(self, tokenizer: object, stops: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = list(stops)
        self.window = max((len(s) for s in self.stops), default=0) + 4

    def hit(self, ids: Sequence[int]) -> bool:
        """True if the text of `ids` ends with a stop string."""
        if not self.stops:
            return False
        text = self.tokenizer.decode(list(ids[-self.window :]), skip_special_tokens=False)  # type: ignore[attr-defined]
        return any(text.endswith(s) for s in self.stops)
