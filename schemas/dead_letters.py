"""The dead-letter stream's record: a packet a tail refused, or a reply a head refused, with the reason (read by
`shardflow dead-letters`, producer/cli_admin.py)."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from schemas.packets import HEADER
from schemas.peek import raw_header
from schemas.requests import SCHEMA_VERSION


class DeadLetterRecord(BaseModel):
    """An entry of the dead-letter stream: a packet a tail refused, or a reply a head refused, with the reason."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    v: Literal[1] = SCHEMA_VERSION
    stream: str
    entry_id: str
    reason: str
    session_id: str | None = None
    round_id: int | None = None
    tail_id: str = ""
    refused_by: Literal["tail", "head"] = "tail"
    header: str = Field("", description="The start of the packet's JSON header, as received.")
    at: float = Field(description="Unix time it was refused.")

    @field_validator("reason", "header", mode="before")
    @classmethod
    def _truncate(cls, v: object, info: ValidationInfo) -> object:
        """Records are capped: a reason keeps 2,000 characters, a header 1,000 (whatever the packet held)."""
        return v[: 2000 if info.field_name == "reason" else 1000] if isinstance(v, str) else v

    def fields(self) -> dict[bytes, bytes]:
        return {HEADER: self.model_dump_json().encode()}


def dead_letter(stream: bytes | str, entry_id: bytes | str, reason: str, packet: object, **more: Any) -> dict:
    """The stream fields of the record of the entry `entry_id` of `stream` (its fields `packet`), refused for
    `reason` now; `more`: the record's other fields (session_id, round_id, tail_id, refused_by)."""
    return DeadLetterRecord(
        stream=stream.decode() if isinstance(stream, bytes) else stream,
        entry_id=entry_id.decode() if isinstance(entry_id, bytes) else entry_id,
        reason=reason,
        header=raw_header(packet),
        at=time.time(),
        **more,
    ).fields()
