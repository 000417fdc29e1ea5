"""ShardFlow's one exception hierarchy.

TransportError: Redis could not be reached or answered in time; retried with tenacity where it happens.
JobError: the generation itself failed (bad request, bad packet, remote failure); never retried by the
transport layer, left to the job system (RQ) to retry or fail.
"""

from __future__ import annotations


class ShardFlowError(Exception):
    """Base of every error ShardFlow raises on purpose."""


class TransportError(ShardFlowError):
    """Redis unreachable, a connection dropped, or no answer in time."""


class ReplyTimeout(TransportError):
    """The tail did not answer a round in time (tail dead, restarting, or overloaded)."""


class TailBusy(TransportError):
    """A tail had no free cache for a new session: the round is sent again after a wait (not a replay)."""


class JobError(ShardFlowError):
    """A generation failed for a reason that retrying the transport cannot fix."""


class InvalidRequest(JobError):
    """A generation request is malformed or impossible (never worth retrying)."""


class PacketError(JobError):
    """A packet failed validation: malformed, truncated, oversized, wrong version, bad tensor."""


class ForgedPacket(PacketError):
    """A packet or reply whose MAC does not verify under its session's key: dropped into the dead-letter
    stream, never answered and never acted on (see schemas/packets.py)."""


class SessionError(JobError):
    """A packet names a session the tail does not hold, or arrives out of order."""


class NonFiniteError(JobError):
    """A shard computed non-finite values (float16 overflow, broken weights): the generation fails, never as
    text, and is not retried (the same inputs would overflow again)."""


class RemoteError(JobError):
    """The tail answered a round with an error."""


class ModelLoadError(ShardFlowError):
    """A model or shard could not be loaded as asked."""
