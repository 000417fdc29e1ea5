"""Every Redis key name ShardFlow uses beside RQ's own, derived from one prefix (`settings.redis.prefix`).

Relay (head <-> tail):
  {prefix}:tail:requests            new sessions; every tail replica reads it through one group
  {prefix}:tails                    that consumer group
  {prefix}:tail:{tail_id}:requests  later rounds of sessions pinned to that tail (its KV cache)
  {prefix}:stage:{a}-{b}:requests   new sessions for the middle stages that run layers a:b (one group: `:stages`)
  {prefix}:stage:{a}-{b}:stages     that consumer group
  {prefix}:stage:{stage_id}:requests later rounds of sessions pinned to that stage
  {prefix}:stages                   running middle stages: members "ID A:B" scored by when they expire (heads
                                    route through the live ones)
  {prefix}:reply:head.{name}.{boot} every reply to one head process's sessions (a group's in one entry); the
                                    head's alone to make, read and expire (`.{epoch}` added once it moves)
  {prefix}:dead-letters             packets tails refused, reply entries heads refused, with the reason
  {prefix}:head:{name}              a running head's boot id, expiring after its reply timeout: tails drop
                                    the sessions of a head whose key is gone or names another boot
Jobs (producer <-> head):
  {prefix}:batch:{batch_id}         a batch: queue, job count, created at
  {prefix}:result:{job_id}          a job's result, written once
  {prefix}:tokens:{job_id}          its committed text as a stream (for --follow)
  {prefix}:ckpt:{job_id}            its committed tokens, where a retry resumes
  {prefix}:cancel:{job_id}          a request to cancel it while it runs
  {prefix}:model:{queue}            what the queue's head workers announce
  {prefix}:api:file:{file_id}       a file uploaded to `shardflow serve` (POST /v1/files), expiring
  {prefix}:api:batches              the batches made through its /v1/batches, by creation time
  {prefix}:api:batches:{owner}      those one API key made (`owner`: a digest of the key, never the key)
The ACL template (deploy/users.acl.template) grants each role its part of these patterns.
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas.settings import RedisSettings


@dataclass(frozen=True)
class Keys:
    """Key names under one prefix."""

    prefix: str = RedisSettings().prefix  # the documented default; processes pass settings.redis.prefix

    # --- relay ---
    @property
    def shared_requests(self) -> str:
        return f"{self.prefix}:tail:requests"

    @property
    def tail_group(self) -> str:
        return f"{self.prefix}:tails"

    def tail_requests(self, tail_id: str) -> str:
        return f"{self.prefix}:tail:{tail_id}:requests"

    def stage_shared(self, layers: tuple[int, int]) -> str:
        """New sessions' rounds for the middle stages that run `layers`."""
        return f"{self.prefix}:stage:{layers[0]}-{layers[1]}:requests"

    def stage_group(self, layers: tuple[int, int]) -> str:
        return f"{self.prefix}:stage:{layers[0]}-{layers[1]}:stages"

    def stage_requests(self, stage_id: str) -> str:
        return f"{self.prefix}:stage:{stage_id}:requests"

    @property
    def stages(self) -> str:
        """Running middle stages: members "ID A:B", scored by the time (Unix seconds) their announcement expires."""
        return f"{self.prefix}:stages"

    def hop_stream(self, hop: str) -> str:
        """The stream of a route's hop (schemas/packets.py `Hop`): `tail`, `tail@ID`, `stage:A-B`, `stage:A-B@ID`."""
        where, _, pinned = hop.partition("@")
        if where == "tail":
            return self.tail_requests(pinned) if pinned else self.shared_requests
        if pinned:
            return self.stage_requests(pinned)
        a, _, b = where.removeprefix("stage:").partition("-")
        return self.stage_shared((int(a), int(b)))

    def reply(self, reply_to: str) -> str:
        """A head's reply stream, by the suffix its rounds name (`head_reply_to`)."""
        return f"{self.prefix}:reply:{reply_to}"

    @property
    def dead_letters(self) -> str:
        return f"{self.prefix}:dead-letters"

    def head(self, name: str) -> str:
        return f"{self.prefix}:head:{name}"

    @staticmethod
    def head_reply_to(name: str, boot: str, epoch: int = 0) -> str:
        """The reply stream suffix where a head process reads every one of its sessions' replies (a later `epoch`:
        the fresh stream it moved to when its first was wedged or gone, workers/head/beacon.py)."""
        return f"head.{name}.{boot}" + (f".{epoch}" if epoch else "")

    # --- jobs ---
    def batch(self, batch_id: str) -> str:
        return f"{self.prefix}:batch:{batch_id}"

    def result(self, job_id: str) -> str:
        return f"{self.prefix}:result:{job_id}"

    def tokens(self, job_id: str) -> str:
        return f"{self.prefix}:tokens:{job_id}"

    def checkpoint(self, job_id: str) -> str:
        return f"{self.prefix}:ckpt:{job_id}"

    def cancel(self, job_id: str) -> str:
        return f"{self.prefix}:cancel:{job_id}"

    def model_info(self, queue: str) -> str:
        return f"{self.prefix}:model:{queue}"

    def api_file(self, file_id: str) -> str:
        return f"{self.prefix}:api:file:{file_id}"

    @property
    def api_batches(self) -> str:
        return f"{self.prefix}:api:batches"

    def api_owner_batches(self, owner: str) -> str:
        return f"{self.prefix}:api:batches:{owner}"
