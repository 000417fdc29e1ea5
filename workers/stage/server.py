"""A middle stage: layers a:b of the model between a head and a tail, one KV cache per session, no verdicts.

Run it with `shardflow stage --target MODEL --layers A:B --redis-url URL`. It reads new sessions from the shared
stream of its layer range (`stage:A-B:requests`, one consumer group for every replica of that range) and later
rounds from its own, runs its layers over each round's hidden rows (a batch of rounds as one forward), and passes
the round on to the next hop its route names (schemas/packets.py `RoundPacket.route`: another stage, or the tail),
sealed again under the session's key, with its own id added to `hops`, the milliseconds it held the round to
`hop_ms`, and its output layer as `layer`. The tail answers the head directly, never back through the stages; its
verdict names the hops, so the head pins the session's later rounds to them, and passes their times on (the
head sums them per hop: `RoundTimings.hop_ms`).

A stage never hears a verdict: it rolls its cache back to the position the session's next round names (the drafts
the tail rejected). Everything else is the tail's (workers/tail/server.py, which it extends): every round's MAC
checked under the session's key before any cache is touched (a forged entry is dead-lettered, never fatal), caches
per session with an expiry, the sessions of gone heads freed, errors answered to the head's reply stream (a lost
session: "replay it", and the head replays onto a live route). It announces its range in `stages` (a member
"ID A:B" scored by when it expires), which heads route through (workers/head/routes.py).
"""

from __future__ import annotations

import logging
import time

import torch

from relay_broker.streams import Reply, merge_replies
from schemas.macs import seal
from schemas.packets import MAX_HOP_MS, RoundPacket, make_round
from workers.engine.numerics import non_finite_error
from workers.tail.rounds import BatchClock, Prepared, forward_inputs, round_ids
from workers.tail.server import TailWorker
from workers.tail.sessions import TailSession

log = logging.getLogger("shardflow.stage")


class StageWorker(TailWorker):
    """Serves the rounds of many sessions through layers a:b (see the module docstring)."""

    role = "stage"
    last = False

    def lanes(self) -> tuple[str, str, str]:
        layers = self.shard.layer_range
        return self.names.stage_group(layers), self.names.stage_shared(layers), self.names.stage_requests(self.tail_id)

    def _keepalive(self) -> None:
        """Now and then: this stage's range announced (heads route through it) and its own stream kept."""
        now = time.monotonic()
        if now - self._last_keepalive < self.settings.relay.tail_keepalive_s and self._last_keepalive:
            return
        self._last_keepalive = now
        a, b = self.shard.layer_range
        until = time.time() + max(3 * self.settings.relay.tail_keepalive_s, 5.0)
        pipe = self.r.pipeline(transaction=False)
        pipe.zadd(self.names.stages, {f"{self.tail_id} {a}:{b}": until})
        pipe.zremrangebyscore(self.names.stages, "-inf", time.time())  # stages that stopped announcing
        pipe.expire(self.names.stage_requests(self.tail_id), self.settings.relay.tail_stream_ttl_s)
        pipe.execute(raise_on_error=False)

    def announce(self) -> None:
        """Announce the range at once (a head routes through a stage only once it is announced)."""
        self._last_keepalive = 0.0
        self._keepalive()

    def _session_for(self, p: RoundPacket, key: bytes, mac: bytes) -> TailSession | None:
        """The tail's rule, after rolling the cache back to where the round starts: the positions the previous
        round's rejected drafts took (a stage never hears the verdict; the next round says where it stands)."""
        sess = self.sessions.get(p.session_id)
        if sess is not None and 0 < p.start_pos < sess.cache.length and p.round_id > sess.last_round:
            sess.cache.crop(p.start_pos)
        return super()._session_for(p, key, mac)

    def pack(self, done: list) -> list:
        """Replies to heads merged per stream as a tail's are; the rounds passed on go one entry each."""
        onward = {i for i, (_, _, reply) in enumerate(done) if reply is not None and reply.onward}
        merged = merge_replies([(s, e, None if i in onward else r) for i, (s, e, r) in enumerate(done)])
        return [done[i] if i in onward else m for i, m in enumerate(merged)]

    def _rounds_together(self, batch: list[Prepared]) -> list[Reply | None]:
        """One forward of the stage's layers over every round, then each round passed on to its next hop."""
        clock = BatchClock(self.shard.device)
        ids = round_ids(batch, self.shard.device) if self.shard.needs_ids else None
        caches, xs, starts, _ = forward_inputs(batch, self.upload)  # every row's hidden states, no logits
        hidden = clock.forward_done(self.engine.forward_many(caches, xs, starts, 0, ids=ids))
        sizes = [h.shape[0] for h in hidden]
        rows = list(torch.cat(hidden).to("cpu").split(sizes)) if hidden else []  # one copy to the host, one wait
        self.clock.add("forward", clock.split()[0] / 1000)
        out: list[Reply | None] = []
        for p, h in zip(batch, rows, strict=True):
            try:
                out.append(self._onward(p, h))
            except Exception as e:
                out.append(self._fail_prepared(p, e))
        return out

    def _held_ms(self) -> float:
        """How long this stage has held the batch being handled: since its entries came off the streams (their wait
        in the batch, their checks, the forward), to this round's sealing; 0 where no read took them (`handle`)."""
        taken = self._taken_at_ms
        return min(max(time.time() * 1000 - taken, 0.0), MAX_HOP_MS) if taken else 0.0  # a clock jump: still sent

    def _onward(self, prep: Prepared, hidden: torch.Tensor) -> Reply:
        """The round as the next hop reads it: this stage's hidden rows, its route one hop on, sealed again."""
        p, sess = prep.packet, prep.sess
        if not torch.isfinite(hidden).all():
            raise non_finite_error("hidden states", self.shard.layer_range, self.shard.dtype)
        header = p.model_dump(exclude={"v", "kind", "key", "tensors", "route", "hops", "hop_ms", "layer"})
        header |= {"route": p.route[1:], "hops": [*p.hops, self.tail_id], "layer": self.shard.layer_range[1]}
        header["hop_ms"] = [*p.hop_ms, self._held_ms()]
        tensors = {name: t for name, t in prep.tensors.items() if name != "hidden"} | {"hidden": hidden}
        codec = p.tensors["hidden"].codec
        _, fields = make_round(header, tensors, prep.key, hidden_codec=codec)
        sess.last_round, sess.last_reply = p.round_id, None
        return Reply(self.names.hop_stream(p.route[0]), seal(prep.key, fields), onward=True)
