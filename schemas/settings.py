"""The one documented place for ShardFlow's defaults.

Every tunable number the workers, relay and CLI fall back on lives here, with what it means.
Command-line flags override these per process; nothing else hard-codes them.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class Defaults(BaseModel):
    """Defaults shared by every ShardFlow process (read-only)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis used as queue and relay.")
    prefix: str = Field("shardflow", description="Namespace of every Redis key ShardFlow writes.")
    draft_k: int = Field(8, description="Draft tokens proposed per round (K).")
    ngram_max: int = Field(3, description="Longest n-gram the prompt-lookup drafter matches.")
    ngram_min: int = Field(1, description="Shortest n-gram the prompt-lookup drafter matches.")
    max_new_tokens: int = Field(128, description="Tokens generated when a request names none.")
    max_packet_bytes: int = Field(64 << 20, description="Largest packet (header + tensors) accepted.")
    max_header_bytes: int = Field(1 << 20, description="Largest JSON header of a packet accepted.")
    max_tensor_elements: int = Field(1 << 26, description="Largest element count of one tensor.")
    reply_timeout_s: float = Field(60.0, description="How long a head waits for a tail's verdict.")
    block_ms: int = Field(1000, description="Redis BLOCK time of stream reads (socket timeout is above).")
    socket_timeout_s: float = Field(30.0, description="Redis socket timeout; must exceed block_ms.")
    request_stream_maxlen: int = Field(10_000, description="Approximate cap of a tail request stream.")
    reply_stream_maxlen: int = Field(64, description="Approximate cap of a session's reply stream.")
    reply_ttl_s: int = Field(600, description="Expiry of a session's reply stream after its last write.")
    max_sessions: int = Field(256, description="Sessions a tail keeps KV caches for (least recent go).")
    session_ttl_s: float = Field(600.0, description="Idle time after which a tail drops a session.")
    connect_attempts: int = Field(8, description="Attempts for a Redis operation on transport errors.")


DEFAULTS = Defaults()
