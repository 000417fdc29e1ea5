"""Verification of drafted tokens on the tail: greedy matching, or speculative rejection sampling.

Rejection sampling (Leviathan et al.; Chen et al.): accept draft x_i with probability
min(1, p_i(x_i) / q_i(x_i)); at the first rejection sample from norm(max(0, p_i - q_i)); after K
acceptances sample the bonus token from p_K. The committed tokens are distributed exactly as the
target's own sampling with the same warping.

`verify_greedy` / `verify_sampling` judge one round. `BatchVerify` judges a tail's whole batch with the same
results, token for token: the batch's logits rows concatenated, one reduction for their finiteness, one argmax
and one comparison for every greedy round, sampled rounds warped together by sampling parameters, and one copy
to the host (two with sampled rounds: their tokens come from per-round generators, one draw each).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from schemas.errors import NonFiniteError, PacketError, SessionError
from schemas.requests import SamplingParams
from workers.engine.numerics import finite_by_row, row_argmax
from workers.speculative.sampling import round_generator, warp


def verify_greedy(logits: torch.Tensor, drafts: list[int]) -> tuple[int, int]:
    """(accepted drafts, next token) for greedy decoding; logits are [k+1, V], drafts host ids: the
    argmax's copy is the round's one device sync."""
    target = row_argmax(logits).tolist()
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == target[accepted]:
        accepted += 1
    return accepted, target[accepted]


def verify_sampling(
    p: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None, gen: torch.Generator
) -> tuple[int, int]:
    """(accepted drafts, next token) by rejection sampling; p [k+1, V] target and q [k, V] draft probs."""
    k = drafts.shape[0]
    if k == 0 or q is None:
        if k:
            raise PacketError("sampled drafts arrived without their draft distribution")
        return 0, int(torch.multinomial(p[0], 1, generator=gen))
    uniforms = torch.rand(k, generator=gen, device=gen.device).tolist() if k else []
    rows = torch.arange(k, device=p.device)
    d = drafts.to(p.device)
    px, qx = p[rows, d].tolist(), q.to(p.device)[rows, d].tolist()
    for i in range(k):
        if qx[i] <= 0.0:
            raise PacketError(f"draft token {int(d[i])} has zero probability under its own q")
        if uniforms[i] * qx[i] < px[i]:
            continue
        residual = (p[i] - q[i].to(p.device)).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # only possible through rounding when p == q
            residual = p[i]
        return i, int(torch.multinomial(residual, 1, generator=gen))
    return k, int(torch.multinomial(p[k], 1, generator=gen))


# --- a whole batch at once ----------------------------------------------------------------------------------------

Outcome = tuple[int, int] | Exception  # (accepted drafts, next token), or why the round failed


def greedy_replay_ok(top: float, value: float) -> bool:
    """A greedy replay reproduces its last committed token: that token's logit is the row's maximum `top`, up to
    a rounding-size tie."""
    return top - value <= 1e-2 * max(1.0, abs(top))


@dataclass(frozen=True)
class RoundCheck:
    """One round as batched verification sees it: its drafts, how it samples (the seed and round pick its
    generator), its q (a packet's q tensors, `decode_q`'s kinds), and for a replay the committed token its first
    logits row must predict. Its logits have `rows` rows: the replay's, then one per draft, then the bonus."""

    drafts: list[int]
    sampling: SamplingParams
    round_id: int = 0
    replay_token: int | None = None
    q_kind: str = "none"
    q: Mapping[str, torch.Tensor] = field(default_factory=dict)
    label: str = ""  # the session, for messages

    @property
    def rows(self) -> int:
        return len(self.drafts) + 1 + (self.replay_token is not None)


class _ToDevice:
    """Host ints for one host-to-device copy; `add` says where its values will lie."""

    def __init__(self) -> None:
        self.values: list[int] = []

    def add(self, values: Sequence[int]) -> slice:
        at = len(self.values)
        self.values.extend(values)
        return slice(at, len(self.values))

    def copy(self, device: torch.device) -> torch.Tensor:
        ids = torch.tensor(self.values, dtype=torch.long)
        if device.type == "cuda":  # from pinned memory the copy is queued, never waited for
            ids = ids.pin_memory()
        return ids.to(device, non_blocking=True)


class _ToHost:
    """Device values for one device-to-host copy (as float64: token ids, flags and float32 values are exact)."""

    def __init__(self) -> None:
        self.parts: list[torch.Tensor] = []
        self.size = 0

    def add(self, t: torch.Tensor) -> slice:
        flat = t.reshape(-1).double()
        self.parts.append(flat)
        self.size += flat.numel()
        return slice(self.size - flat.numel(), self.size)

    def fetch(self) -> list[float]:
        return torch.cat(self.parts).tolist() if self.parts else []


@dataclass
class _Chunk:
    """Consecutive rows of sampled rounds that warp alike (temperature, top-k, top-p), warped as one tensor."""

    sampling: SamplingParams
    start: int  # first row in the batch's concatenated logits
    size: int = 0
    picks: list[tuple[int, int]] = field(default_factory=list)  # (row, token): p at each draft
    replays: list[tuple[int, int]] = field(default_factory=list)  # (row, token): p at a replay's last token
    ids: tuple[slice, slice, slice, slice] = (slice(0), slice(0), slice(0), slice(0))
    probs: torch.Tensor | None = None
    at: dict[str, slice] = field(default_factory=dict)  # where its values lie in the host copy


@dataclass
class _Sampled:
    """A sampled round's place in its chunk and what it draws and copies."""

    i: int
    chunk: _Chunk
    first: int  # its first draft's row within the chunk
    pick: int  # its first draft's entry in the chunk's picks
    replay: int | None  # its entry in the chunk's replays
    drafts: slice = field(default_factory=lambda: slice(0))
    gen: torch.Generator | None = None
    q: torch.Tensor | None = None  # dense q [k, V] on the device (None: point or none)
    error: Exception | None = None  # a q malformed in what the host already knows (its shapes)
    at: dict[str, slice] = field(default_factory=dict)


def _warp_key(s: SamplingParams) -> tuple[float, float, int]:
    return (s.temperature, s.top_p, s.top_k)


class BatchVerify:
    """Verification of a batch's rounds together, token for token what `verify_greedy` / `verify_sampling` give
    each round alone (tests/test_verify.py compares them).

    Made before the logits exist (the host work, and its one host-to-device copy of ids, overlap the forward);
    `run(logits)` (once) then takes one copy to the host for the batch: every row's finiteness (one reduction over the
    concatenated logits), every greedy round's (accepted, next) from one argmax and one comparison with the
    drafts, the replays' checks, and what the sampled rounds decide with. Sampled rounds warp in chunks of at
    most `warp_rows` rows that share their sampling parameters; each keeps its own generator
    (`round_generator(seed, round, "verify")`) and draws from it exactly what it draws alone (its uniforms, then
    one multinomial): those draws are one call per round, and their tokens one more copy to the host."""

    def __init__(self, checks: Sequence[RoundCheck], device: torch.device | str, warp_rows: int) -> None:
        self.checks, self.device = list(checks), torch.device(device)
        greedy = [i for i, c in enumerate(self.checks) if c.sampling.greedy]
        sampled = sorted(
            (i for i, c in enumerate(self.checks) if not c.sampling.greedy),
            key=lambda i: _warp_key(self.checks[i].sampling),
        )
        self.order = greedy + sampled  # the concatenated logits' order: greedy rounds, then sampled ones by kind
        self.start: dict[int, int] = {}
        rows = 0
        for i in self.order:
            self.start[i], rows = rows, rows + self.checks[i].rows
        self.greedy, self.greedy_rows = greedy, sum(self.checks[i].rows for i in greedy)
        self.top_token = max((t for c in self.checks for t in (*c.drafts, c.replay_token or 0)), default=0)
        ids = _ToDevice()
        self._lay_out_greedy(ids)
        self.chunks, self.sampled = self._lay_out_sampled(sampled, max(warp_rows, 1), ids)
        self.ids = ids.copy(self.device) if self.checks else torch.zeros(0, dtype=torch.long)

    def _lay_out_greedy(self, ids: _ToDevice) -> None:
        """Per greedy row the draft it must equal (-1 at bonus and replay rows: never an argmax), per round where
        its drafts start, and the replays' rows."""
        want, starts, replays = [], [], []
        for i in self.greedy:
            c, at = self.checks[i], self.start[i]
            if c.replay_token is not None:
                replays.append((at, c.replay_token))
                want.append(-1)
                at += 1
            starts.append(at)
            want += [*c.drafts, -1]
        self.g_ids = (ids.add(want), ids.add(starts))
        self.g_replays = [i for i in self.greedy if self.checks[i].replay_token is not None]
        self.g_replay_of = {i: j for j, i in enumerate(self.g_replays)}
        self.g_at: dict[str, slice] = {}
        self.g_replay_ids = (ids.add([r for r, _ in replays]), ids.add([t for _, t in replays]))

    def _lay_out_sampled(
        self, sampled: list[int], warp_rows: int, ids: _ToDevice
    ) -> tuple[list[_Chunk], list[_Sampled]]:
        chunks: list[_Chunk] = []
        rounds: list[_Sampled] = []
        for i in sampled:
            c = self.checks[i]
            last = chunks[-1] if chunks else None
            if last is None or _warp_key(last.sampling) != _warp_key(c.sampling) or last.size + c.rows > warp_rows:
                last = _Chunk(c.sampling, self.start[i])
                chunks.append(last)
            first = self.start[i] - last.start + (c.replay_token is not None)
            s = _Sampled(i, last, first, len(last.picks), len(last.replays) if c.replay_token is not None else None)
            if c.replay_token is not None:
                last.replays.append((first - 1, c.replay_token))
            last.picks += [(first + j, d) for j, d in enumerate(c.drafts)]
            last.size += c.rows
            s.drafts = ids.add(c.drafts)
            rounds.append(s)
        for ch in chunks:
            ch.ids = (
                ids.add([r for r, _ in ch.picks]),
                ids.add([t for _, t in ch.picks]),
                ids.add([r for r, _ in ch.replays]),
                ids.add([t for _, t in ch.replays]),
            )
        return chunks, rounds

    def run(self, logits: Sequence[torch.Tensor], non_finite: Callable[[], Exception] | None = None) -> list[Outcome]:
        """Each round's (accepted, next token), or its error: `non_finite()` for a round with a non-finite
        logit, SessionError for a replay that does not reproduce its token, PacketError for a malformed q."""
        if not self.checks:
            return []
        for c, lg in zip(self.checks, logits, strict=True):
            if lg.ndim != 2 or lg.shape[0] != c.rows:
                raise ValueError(f"logits {list(lg.shape)} for a round of {c.rows} rows")
        rows = torch.cat([logits[i] for i in self.order]) if len(self.order) > 1 else logits[0]
        if self.top_token >= rows.shape[-1]:
            raise PacketError(f"token ids must be below the vocabulary size {rows.shape[-1]}")
        host = _ToHost()
        row_ok, high = finite_by_row(rows)
        finite = host.add(row_ok)
        self._greedy_on_device(rows, high, host)
        self._sampled_on_device(rows, host)
        got = host.fetch()  # the batch's one wait for the device
        ok = got[finite]
        out: list[Outcome | None] = [None] * len(self.checks)
        for i, c in enumerate(self.checks):
            if not all(ok[self.start[i] : self.start[i] + c.rows]):
                out[i] = non_finite() if non_finite else NonFiniteError("non-finite logits")
        for g, i in enumerate(self.greedy):
            if out[i] is None:
                out[i] = self._greedy_outcome(i, g, got)
        draws: list[tuple[_Sampled, int, torch.Tensor]] = []
        for s in self.sampled:
            if out[s.i] is None:
                decided = self._decide(s, got)
                if isinstance(decided, Exception):
                    out[s.i] = decided
                else:
                    draws.append((s, *decided))
        if draws:  # each round's own generator, drawn from as verify_sampling draws: then one copy of the tokens
            tokens = torch.cat([torch.multinomial(dist, 1, generator=s.gen) for s, _, dist in draws]).tolist()
            for (s, accepted, _), token in zip(draws, tokens, strict=True):
                out[s.i] = (accepted, int(token))
        return out  # type: ignore[return-value]

    def _greedy_on_device(self, rows: torch.Tensor, high: torch.Tensor, host: _ToHost) -> None:
        """One argmax over the greedy rows and one comparison with the drafts: per round the first row from its
        first draft's on whose argmax is not its draft (its bonus row at the latest: rounds never run into each
        other), so (accepted, next) for every round at once."""
        if not self.greedy:
            return
        size = self.greedy_rows
        want, starts = (self.ids[s] for s in self.g_ids)
        best = row_argmax(rows[:size])
        missed = torch.where(best != want, torch.arange(size, device=rows.device), size)
        next_miss = missed.flip(0).cummin(0).values.flip(0)  # per row, the first miss at or after it
        first = next_miss[starts].clamp_max(size - 1)  # the clamp only guards the indexing
        self.g_at = {"accepted": host.add(first - starts), "next": host.add(best[first])}
        if self.g_replays:
            r, t = (self.ids[s] for s in self.g_replay_ids)
            self.g_at |= {"top": host.add(high[r].float()), "value": host.add(rows[r, t].float())}

    def _greedy_outcome(self, i: int, g: int, got: list[float]) -> Outcome:
        if i in self.g_replay_of:
            j = self.g_replay_of[i]
            if not greedy_replay_ok(got[self.g_at["top"]][j], got[self.g_at["value"]][j]):
                return self._replay_error(i)
        return int(got[self.g_at["accepted"]][g]), int(got[self.g_at["next"]][g])

    def _replay_error(self, i: int) -> SessionError:
        label = self.checks[i].label
        return SessionError(f"replay of session {label} does not reproduce its last committed token")

    def _sampled_on_device(self, rows: torch.Tensor, host: _ToHost) -> None:
        """Warp each chunk; gather p at the drafts and replays, q at the drafts; draw each round's uniforms."""
        vocab = rows.shape[-1]
        for ch in self.chunks:
            ch.probs = warp(rows[ch.start : ch.start + ch.size], ch.sampling)
            ch.at["ok"] = host.add(finite_by_row(ch.probs)[0])  # warped rows are >= 0 unless NaN
            pr, pt, rr, rt = (self.ids[s] for s in ch.ids)
            ch.at["px"] = host.add(ch.probs[pr, pt])
            if ch.replays:
                ch.at["replay"] = host.add(ch.probs[rr, rt])
        for s in self.sampled:
            c = self.checks[s.i]
            k = len(c.drafts)
            s.gen = round_generator(c.sampling.seed or 0, c.round_id, "verify", rows.device)
            if k == 0:
                continue
            s.at["u"] = host.add(torch.rand(k, generator=s.gen, device=s.gen.device))
            self._q_on_device(s, c, k, vocab, host)

    def _q_on_device(self, s: _Sampled, c: RoundCheck, k: int, vocab: int, host: _ToHost) -> None:
        """A round's q as `decode_q` builds it, without its host syncs: a sparse q's ids are checked on the
        device (and clamped for the scatter, so a bad one fails its round rather than the device)."""
        d = self.ids[s.drafts]
        if c.q_kind == "dense":
            q = c.q["q"].float().to(d.device)
            if q.shape != (k, vocab):
                s.error = PacketError(f"dense q is {list(q.shape)}, expected [{k}, {vocab}]")
                return
        elif c.q_kind == "sparse":
            idx, val = c.q["q_idx"].long().to(d.device), c.q["q_val"].float().to(d.device)
            if idx.shape != val.shape:
                s.error = PacketError("q_idx and q_val shapes differ")
                return
            if idx.numel():
                s.at["in_vocab"] = host.add((idx.min() >= 0) & (idx.max() < vocab))
            q = torch.zeros(k, vocab, device=d.device).scatter_(1, idx.clamp(0, vocab - 1), val)
        else:
            return  # point: q(x) = 1 at each draft; none: no q (an error when there are drafts)
        s.q = q
        s.at["qx"] = host.add(q.gather(1, d[:, None])[:, 0])
        s.at["q_ok"] = host.add(finite_by_row(q)[0])

    def _decide(self, s: _Sampled, got: list[float]) -> Exception | tuple[int, torch.Tensor]:
        """A sampled round's acceptances, as `verify_sampling` decides them from the same values, and the
        distribution its next token is drawn from; or its error."""
        c, ch = self.checks[s.i], s.chunk
        k = len(c.drafts)
        if s.replay is not None and not got[ch.at["replay"]][s.replay] > 0:
            return self._replay_error(s.i)
        if s.error is not None:
            return s.error
        if "in_vocab" in s.at and not got[s.at["in_vocab"]][0]:
            return PacketError("q_idx holds a token outside the vocabulary")
        if k and c.q_kind == "none":
            return PacketError("sampled drafts arrived without their draft distribution")
        px = got[ch.at["px"]][s.pick : s.pick + k]
        qx = got[s.at["qx"]] if "qx" in s.at else [1.0] * k
        u = got[s.at["u"]] if k else []
        probs = ch.probs
        assert probs is not None
        for j in range(k):
            if qx[j] <= 0.0:
                return PacketError(f"draft token {c.drafts[j]} has zero probability under its own q")
            if u[j] * qx[j] < px[j]:
                continue
            if not got[ch.at["ok"]][s.first + j]:
                return self._not_probabilities(c, j)
            if "q_ok" in s.at and not got[s.at["q_ok"]][j]:
                return PacketError(f"row {j} of the draft distribution q is not finite")
            p = probs[s.first + j]
            if s.q is not None:
                q = s.q[j]
            else:  # point: one-hot at the draft
                q = torch.zeros_like(p).index_fill_(0, self.ids[s.drafts][j : j + 1], 1.0)
            residual = (p - q).clamp_min(0.0)
            return j, torch.where(residual.any(), residual, p)  # no mass left (rounding when p == q): p itself
        if not got[ch.at["ok"]][s.first + k]:
            return self._not_probabilities(c, k)
        return k, probs[s.first + k]

    @staticmethod
    def _not_probabilities(c: RoundCheck, j: int) -> NonFiniteError:
        """Finite logits whose warped row is not a distribution (a temperature so small that they overflow):
        checked here, since a multinomial over it would stop a CUDA device (an assert) rather than fail a round."""
        t = c.sampling.temperature
        return NonFiniteError(f"the target's probabilities of row {j} are not finite (temperature {t} too small?)")
