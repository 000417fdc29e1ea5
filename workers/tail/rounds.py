"""A tail's rounds between decoding and the verdict: what a checked round carries (`Prepared`), how the drafts
are judged against the target's logits (greedy, or rejection sampling; a replay first checks it reproduces
its last committed token), and what a refused packet leaves for the dead-letter stream.

`judge` judges one round; `plan_rounds` makes the batched verification of a whole batch (`BatchVerify`, with the
same results), and `BatchClock` times its forward without a sync of its own."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch

from relay_broker.streams import Entry
from schemas.dead_letters import dead_letter
from schemas.errors import PacketError, SessionError, ShardFlowError
from schemas.groups import entry_parts
from schemas.packets import RoundPacket
from workers.engine.shard import Cache
from workers.shares import Shares
from workers.speculative.sampling import decode_q, round_generator, warp
from workers.speculative.verify import BatchVerify, RoundCheck, greedy_replay_ok, verify_greedy, verify_sampling
from workers.tail.sessions import TailSession

log = logging.getLogger("shardflow.tail")


@dataclass
class Prepared:
    """A decoded, checked round waiting for the batched forward."""

    packet: RoundPacket
    sess: TailSession
    key: bytes
    hidden: torch.Tensor
    tensors: dict[str, torch.Tensor]
    fields: dict


@dataclass
class DeadLetter:
    """A refused packet and why, until it is written to the dead-letter stream."""

    fields: dict
    reason: str
    session_id: str | None
    round_id: int | None

    def record(self, stream: bytes | str, entry_id: bytes, tail_id: str) -> dict:
        return dead_letter(
            stream,
            entry_id,
            self.reason,
            self.fields,
            session_id=self.session_id,
            round_id=self.round_id,
            tail_id=tail_id,
        )


def rewind(p: Prepared) -> None:
    """Back to where the round started (a failed batched forward may have written part of it)."""
    if p.sess.cache.length > p.packet.start_pos:
        p.sess.cache.crop(p.packet.start_pos)


def check_replay(p: RoundPacket, logits: torch.Tensor) -> None:
    """A replayed session must predict its own last committed token (greedy: as the argmax, up to a
    rounding-size tie; sampled: with nonzero probability), or this tail is not computing what the
    first one did."""
    last = p.input_ids[-1]
    if p.sampling.greedy:
        ok = greedy_replay_ok(float(logits.max()), float(logits[last]))
    else:
        ok = float(warp(logits[None], p.sampling)[0, last]) > 0
    if not ok:
        raise SessionError(f"replay of session {p.session_id} does not reproduce its last committed token")


def judge(prep: Prepared, logits: torch.Tensor) -> tuple[int, int]:
    """(drafts accepted, the correction or bonus token) of one round, from its rows' logits."""
    p = prep.packet
    if p.replay:
        check_replay(p, logits[0])
        logits = logits[1:]
    if p.sampling.greedy:
        return verify_greedy(logits, p.draft_ids)
    drafts = torch.tensor(p.draft_ids, dtype=torch.long, device=logits.device)
    probs = warp(logits, p.sampling)
    q = decode_q(p.q_kind, drafts, prep.tensors, probs.shape[-1])
    gen = round_generator(p.sampling.seed or 0, p.round_id, "verify", logits.device)
    return verify_sampling(probs, drafts, q, gen)


def forward_inputs(
    batch: list[Prepared], upload: HostToDevice
) -> tuple[list[Cache], list[torch.Tensor], list[int], list[int]]:
    """`Engine.forward_many`'s arguments for a batch of rounds: caches, hidden states (decoded on the host, on
    the shard's device in one copy), starts, and the logits rows each round verifies (its replay's, one per
    draft, the bonus)."""
    rounds = [b.packet for b in batch]
    wants = [len(p.draft_ids) + 1 + p.replay for p in rounds]
    return [b.sess.cache for b in batch], upload([b.hidden for b in batch]), [p.start_pos for p in rounds], wants


def round_ids(batch: list[Prepared], device: torch.device) -> list[torch.Tensor]:
    """Each round's token ids, the ids of its hidden rows ([input_ids, draft_ids]), on the device: a shard whose
    layers take per-layer inputs from them (Gemma 4, workers/engine/per_layer.py) is given them beside the rows."""
    rounds = [b.packet for b in batch]
    flat = torch.tensor([t for p in rounds for t in (*p.input_ids, *p.draft_ids)], dtype=torch.long)
    return list(flat.to(device).split([len(p.input_ids) + len(p.draft_ids) for p in rounds]))  # one copy


def _entry_ms(entry_id: bytes | str) -> int | None:
    """The millisecond time in a stream entry's id (None for an id that carries none)."""
    ms = (entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)).partition("-")[0]
    return int(ms) if ms.isdigit() else None


def entries_age_ms(entries: list[Entry]) -> float:
    """How long these stream entries have waited since Redis added them (the mean over their ids' millisecond
    times, against this host's clock: a tail runs beside its Redis), 0 for ids that carry no time."""
    now_ms = time.time() * 1000
    ages = [max(now_ms - ms, 0.0) for _, entry_id, _ in entries if (ms := _entry_ms(entry_id)) is not None]
    return sum(ages) / len(ages) if ages else 0.0


class HostToDevice:
    """A batch's hidden rows (host tensors of one dtype and width, maybe read-only views of their packets' bytes) to
    the device in one copy (never the tensors given) through a pinned staging buffer, kept and grown as batches need
    (up to PINNED_MAX_BYTES; larger batches, prompts mostly, go in one plain copy). A copy per session from pageable
    memory waits for the device each time: at 64 sessions a batch, 12% of a tail's loop on an H200 shared with its
    head (py-spy, decode_tensor)."""

    PINNED_MAX_BYTES = 64 << 20

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buf: torch.Tensor | None = None
        self._done: torch.cuda.Event | None = None  # the last copy out of the buffer

    def __call__(self, hs: list[torch.Tensor]) -> list[torch.Tensor]:
        sizes = [h.shape[0] for h in hs]
        if self.device.type != "cuda" or not hs:  # copied: the rows may be views of their packets' bytes
            return list(torch.cat(hs).to(self.device).split(sizes)) if hs else []
        n, width, dtype = sum(sizes), hs[0].shape[1], hs[0].dtype
        if n * width * dtype.itemsize > self.PINNED_MAX_BYTES:
            return list(torch.cat(hs).to(self.device).split(sizes))
        if self._done is not None:
            self._done.synchronize()  # (long done: the last batch's verification waited for the device)
        if self._buf is None or self._buf.dtype != dtype or self._buf.numel() < n * width:
            self._buf = torch.empty(max(n * width, 1 << 20), dtype=dtype).pin_memory()
        host = self._buf[: n * width].view(n, width)
        torch.cat(hs, out=host)
        with torch.cuda.device(self.device):
            out = host.to(self.device, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()
        return list(out.split(sizes))


def round_check(prep: Prepared) -> RoundCheck:
    """What batched verification needs of a prepared round."""
    p = prep.packet
    replay = p.input_ids[-1] if p.replay else None
    seed_round = p.round_id if p.seed_round is None else p.seed_round  # a long prompt's parts draw nothing
    return RoundCheck(p.draft_ids, p.sampling, seed_round, replay, p.q_kind, prep.tensors, p.session_id)


def plan_rounds(batch: list[Prepared], device: torch.device, warp_rows: int) -> BatchVerify:
    """The batch's verification, laid out (and its ids on their way to `device`) before its forward runs."""
    return BatchVerify([round_check(p) for p in batch], device, warp_rows)


class BatchClock:
    """A batch's forward and verification times with no sync of their own: on CUDA, events around the forward,
    read once verification has waited for the device anyway; on a CPU, the wall clock."""

    def __init__(self, device: torch.device) -> None:
        self.t0 = time.perf_counter()
        self.events = device.type == "cuda"
        if self.events:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()

    def forward_done(self, logits: list[torch.Tensor]) -> list[torch.Tensor]:
        """Mark the end of the forward (queued, on CUDA) that returned these logits; returns them."""
        if self.events:
            self.end.record()
        self.t1 = time.perf_counter()
        return logits

    def split(self) -> tuple[float, float]:
        """(forward ms, verification ms) once the batch is verified."""
        total = (time.perf_counter() - self.t0) * 1000
        if self.events:
            self.end.synchronize()  # done already: verification copied its results after it
            forward = self.start.elapsed_time(self.end)
        else:
            forward = (self.t1 - self.t0) * 1000
        return forward, max(total - forward, 0.0)


def expand_groups(
    entries: list[Entry], max_bytes: int, shares: Shares | None = None
) -> tuple[list[Entry], list[tuple[bytes, bytes, DeadLetter]]]:
    """The stream entries with each group entry (schemas/groups.py) replaced by its sessions' rounds, each keeping
    the group's stream and entry id; a group whose container is malformed is refused whole (no part of it can
    be trusted to be where the index says). Unpacking hashes each group's tensors once (their binding): with
    `shares`, several groups' side by side."""
    unpack = partial(_parts_of, max_bytes=max_bytes)
    nbytes = sum(len(v) for _, _, fields in entries for v in fields.values())
    got = shares.map(unpack, entries, nbytes) if shares is not None else unpack(entries)
    out: list[Entry] = []
    bad: list[tuple[bytes, bytes, DeadLetter]] = []
    for (stream, entry_id, fields), parts in zip(entries, got, strict=True):
        if isinstance(parts, PacketError):
            bad.append((stream, entry_id, DeadLetter(fields, str(parts), None, None)))
        else:
            out += [(stream, entry_id, part) for part in parts]
    return out, bad


def _parts_of(entries: Sequence[Entry], max_bytes: int) -> list[list[dict] | PacketError]:
    out: list[list[dict] | PacketError] = []
    for _, _, fields in entries:
        try:
            out.append(entry_parts(fields, max_bytes=max_bytes))
        except PacketError as e:
            out.append(e.with_traceback(None))  # its frames hold the entry: no cycle through `out` (see auth.py)
    return out


def reason_of(e: Exception) -> str:
    """Why a packet was refused, as its dead letter and error reply say."""
    return str(e) if isinstance(e, ShardFlowError) else f"internal error: {type(e).__name__}: {e}"


def log_bad(sid: str | None, rid: int | None, e: Exception) -> None:
    internal = not isinstance(e, ShardFlowError)
    (log.exception if internal else log.warning)("bad packet (session %s, round %s): %s", sid, rid, reason_of(e))
