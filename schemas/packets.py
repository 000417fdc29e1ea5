"""Relay packets between head and tail, and their Redis stream encoding.

A stream entry holds field `h` (the JSON header, one of the models below), one binary field `t.<name>` per
tensor the header declares, and `m`, an HMAC-SHA256 of the header and those tensors' bytes as sent (compressed
where the header names a codec: schemas/codec.py) under the session's key (a group entry's part: of its header and
its binding to the group's tensors, schemas/groups.py). Decoding validates size caps, the JSON, the version, each
tensor's dtype/shape/byte length, and the packet's own consistency before anything is computed.

**Sessions are authenticated.** The head draws a random 32-byte key per generation; only the rounds that open a
session on a tail (start_pos 0: the first round, and replays) carry it, and every head -> tail packet and every tail
-> head reply is MAC'd with it (schemas/macs.py `seal`, `authentic`). A tail checks a round's MAC under the key of
the session it holds before anything touches a cache, and a head drops a reply whose MAC does not verify. The one
unsigned reply is a tail's "I do not hold this session" (it has no key): it carries the MAC of the round it answers
(`echo`), which only a reader of that round could know, and it can only ever cost a replay. Readers of the tails'
request streams see the keys: under the ACL file only tails can; on a Redis without ACLs anyone can, and the MACs
then protect nothing. A malicious tail can always lie.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from schemas.codec import Codec, TensorCodec, is_lossy
from schemas.errors import PacketError
from schemas.macs import DIGEST, HEADER, MAC, TENSOR_PREFIX, seal
from schemas.requests import FinishReason, SamplingParams, SessionId, TokenId
from schemas.settings import RelaySettings
from schemas.tensors import TensorMeta, decode_tensor, encode_tensor, tensor_meta

CAPS = RelaySettings()  # the documented caps, for callers that pass none (a worker passes settings.relay)
# Relay packets (head <-> tail) speak their own protocol version; stored shapes keep SCHEMA_VERSION.
# 2: per-session keys and MACs, the head's identity in every round. 3: long prompts in parts (prefill_more,
# seed_round), a replay's last part past position 0. 4: a group's parts MAC their header and their place in the
# group's tensors, whose one digest binds the bytes (schemas/groups.py), rather than each its own tensors' bytes.
# Within 4, a tensor's meta may name a codec (schemas/codec.py); a raw tensor's names none, so a raw round is byte for
# byte what it was and every version-4 packet still decodes, and a build without codecs refuses a compressed one
# ("tensors.hidden.codec: Extra inputs are not permitted"). The 8-bit codecs (opt-in, lossy: `relay.wire`) came within 4
# too: a build before them refuses such a round's header ("Input should be 'raw' or 'zstd-planes'"), only a round's
# hidden rows may name one, and a raw or lossless round is unchanged. The middle stages' fields (a round's layer,
# route, hops and hop_ms, a verdict's hops and hop_ms) came within 4 too: a build before them refuses every round.
PROTOCOL_VERSION = 4
HexKey = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
ReplyTo = Annotated[str, Field(pattern=r"^head\.[A-Za-z0-9_.:-]{1,160}$")]  # `Keys.head_reply_to`: a head's stream

# How the draft distribution q travels: none (greedy), point (deterministic drafter: q(x)=1),
# sparse (indices + probabilities of its support), dense (full vocabulary rows).
QKind = Literal["none", "point", "sparse", "dense"]
TailId = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{0,64}$")]
# A hop of a round's route (`Keys.hop_stream` names its stream under the reader's own prefix, so a route can name no
# other stream): `tail` or `stage:A-B` (the shared stream of the tails, or of the middle stages that run layers
# A:B), `@ID` added once the session is pinned to that worker
Hop = Annotated[str, Field(pattern=r"^(tail|stage:[0-9]{1,5}-[0-9]{1,5})(@[A-Za-z0-9_.-]{1,64})?$")]
# How long a middle stage held a round, in ms (from taking its entry off its stream to handing the round on: its wait
# in the batch and its forward); a day at most, as a head's reply timeout is
MAX_HOP_MS = 86_400_000.0
HopMs = Annotated[float, Field(ge=0, le=MAX_HOP_MS, allow_inf_nan=False)]
HOP_TIMES = "hop_ms must hold one time per hop"


class HeadRef(BaseModel):
    """The head a session belongs to: its name, the process's boot id, and how long it waits for a verdict.
    A running head keeps `{prefix}:head:{name}` set to its boot id (expiring after its reply timeout): a tail
    drops the sessions of a head whose key is gone or names another boot (workers/tail/liveness.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,96}$")
    boot: str = Field(pattern=r"^[0-9a-f]{8,32}$")
    reply_timeout_s: float = Field(gt=0, le=86400)


class RoundPacket(BaseModel):
    """Head -> tail: hidden states of [input_ids, draft_ids] at positions start_pos.. to verify."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    v: Literal[4] = PROTOCOL_VERSION
    kind: Literal["round"] = "round"
    session_id: SessionId
    head: HeadRef
    key: HexKey | None = Field(None, description="The session's key: in rounds that open a session (start_pos 0) only.")
    reply_to: ReplyTo = Field(description="Its head's reply stream (`reply:REPLY_TO`), read for all its sessions.")
    round_id: int = Field(ge=0)
    start_pos: int = Field(ge=0, description="Position of input_ids[0]; the tail holds 0..start_pos.")
    input_ids: list[TokenId] = Field(min_length=1, description="Committed tokens not yet cached.")
    draft_ids: list[TokenId] = Field(max_length=64)
    sampling: SamplingParams
    eos_token_ids: list[TokenId] = Field(max_length=16)
    max_new: int = Field(ge=1, description="Tokens this round may still commit before 'length'.")
    q_kind: QKind
    tensors: dict[str, TensorMeta] = Field(max_length=4)
    replay: bool = Field(
        False,
        description="A session resumed on a new tail: input_ids replay the committed sequence (from 0, or after "
        "the parts already sent); the tail checks (greedy) that it predicts its last token before the drafts.",
    )
    seed_round: int | None = Field(
        None,
        ge=0,
        description="The round's index for its random draws, where it is not round_id: a long prompt's parts take "
        "round ids, never seeds, so a seeded generation samples the same text however many parts it took.",
    )
    prefill_more: int = Field(
        0,
        ge=0,
        description="Committed tokens still to come after input_ids, in later rounds: a long prompt (or replay) in "
        "parts under the packet cap. Such a round only caches its rows: it has no drafts and commits nothing.",
    )
    layer: int | None = Field(
        None,
        ge=0,
        description="The first layer its hidden rows enter: a worker whose layers start elsewhere refuses it (None: "
        "unchecked, a two-worker head of before).",
    )
    route: list[Hop] = Field(
        default_factory=list,
        max_length=16,
        description="Where the round goes after the worker that reads it, in order (middle stages, the tail last); "
        "empty: that worker is the tail.",
    )
    hops: list[TailId] = Field(
        default_factory=list,
        max_length=16,
        description="The middle stages it passed through, in order (each adds its id): the tail's verdict names them, "
        "so the head pins the session's later rounds to them.",
    )
    hop_ms: list[HopMs] = Field(
        default_factory=list,
        max_length=16,
        description="Each middle stage's time with the round in ms, parallel to hops (each stage adds its own): the "
        "tail's verdict passes them on for the head's timings (`RoundTimings.hop_ms`).",
    )

    @model_validator(mode="after")
    def _consistent(self) -> RoundPacket:
        n, k = len(self.input_ids) + len(self.draft_ids), len(self.draft_ids)
        hidden = self.tensors.get("hidden")
        if hidden is None or len(hidden.shape) != 2 or hidden.shape[0] != n:
            raise ValueError(f"tensor 'hidden' must be [{n}, hidden_size]")
        need: dict[str, int] = {"none": 0, "point": 0, "sparse": 2, "dense": 1}
        if (self.sampling.greedy or k == 0) != (self.q_kind == "none"):
            raise ValueError(f"q_kind {self.q_kind!r} does not fit {k} drafts at this temperature")
        if len(self.tensors) != 1 + need[self.q_kind]:
            raise ValueError(f"q_kind {self.q_kind!r} needs {need[self.q_kind]} q tensors")
        if lossy := sorted(name for name, meta in self.tensors.items() if name != "hidden" and is_lossy(meta.codec)):
            raise ValueError(f"only the hidden rows may travel 8-bit (lossy), not {lossy}")
        for name in {"sparse": ("q_idx", "q_val"), "dense": ("q",)}.get(self.q_kind, ()):
            meta = self.tensors.get(name)
            if meta is None or len(meta.shape) != 2 or meta.shape[0] != k:
                raise ValueError(f"tensor {name!r} must have {k} rows")
        if self.replay and len(self.input_ids) < 2:
            raise ValueError("a replay round holds at least two committed tokens")
        if self.prefill_more and (k or self.replay):
            raise ValueError("a part of a prompt (prefill_more > 0) carries no drafts and is no replay")
        if (self.key is None) != (self.start_pos > 0):
            raise ValueError("a round that opens a session (start_pos 0) carries its key, and no other does")
        if len(self.hop_ms) != len(self.hops):
            raise ValueError(HOP_TIMES)
        return self


class ClosePacket(BaseModel):
    """Head -> tail: the session is over; free its cache."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    v: Literal[4] = PROTOCOL_VERSION
    kind: Literal["close"] = "close"
    session_id: SessionId


class Verdict(BaseModel):
    """Tail -> head: the tokens one round commits (accepted drafts + correction/bonus, stops applied)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    v: Literal[4] = PROTOCOL_VERSION
    kind: Literal["verdict"] = "verdict"
    session_id: SessionId
    round_id: int = Field(ge=0)
    accepted: int = Field(ge=0, description="Draft tokens the target accepted.")
    tokens: list[TokenId] = Field(description="Tokens committed this round, after EOS/length stops.")
    next_token: TokenId | None = Field(description="Correction or bonus token; None if a stop cut it.")
    finish_reason: FinishReason | None = None
    tail_id: TailId = ""
    hops: list[TailId] = Field(default_factory=list, max_length=16, description="The round's middle stages.")
    hop_ms: list[HopMs] = Field(
        default_factory=list, max_length=16, description="Each middle stage's time with the round (ms), as it came."
    )
    timings: dict[str, float] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _hop_times(self) -> Verdict:
        if len(self.hop_ms) != len(self.hops):
            raise ValueError(HOP_TIMES)
        return self


class ErrorReply(BaseModel):
    """Tail -> head: the round (or the whole packet) could not be processed."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    v: Literal[4] = PROTOCOL_VERSION
    kind: Literal["error"] = "error"
    session_id: SessionId
    round_id: int | None = None
    error: str
    tail_id: TailId = ""
    retryable: bool = Field(False, description="The tail lost the session: replay it instead of failing.")
    busy: bool = Field(False, description="The tail has no free cache for a new session: send the round again.")
    non_finite: bool = Field(False, description="The tail's logits were not finite: fail the generation, no replay.")
    echo: str | None = Field(
        None,
        pattern=r"^[0-9a-f]{64}$",
        description="Unsigned replies only (a tail that does not hold the session has no key): the MAC of the "
        "round answered. The head takes such a reply only as 'replay the session', never as final.",
    )

    @model_validator(mode="after")
    def _echo_only_to_replay(self) -> ErrorReply:
        if self.echo is not None and not (self.retryable and not self.busy and not self.non_finite):
            raise ValueError("an echoed (unsigned) error reply can only ask for a replay")
        return self


HeadMessage = Annotated[RoundPacket | ClosePacket, Field(discriminator="kind")]
TailMessage = Annotated[Verdict | ErrorReply, Field(discriminator="kind")]
_HEAD = TypeAdapter(HeadMessage)
_TAIL = TypeAdapter(TailMessage)


def encode_round(
    packet_fields: dict,
    tensors: dict[str, torch.Tensor],
    key: bytes,
    *,
    codec: Codec = "raw",
    hidden_codec: TensorCodec | None = None,
) -> tuple[RoundPacket, dict]:
    """Build a RoundPacket from header fields + tensors and return it with its sealed stream fields (a round
    that opens a session, start_pos 0, carries the key); every tensor travels under `codec` (schemas/codec.py),
    its hidden rows under `hidden_codec` where given (an 8-bit one: lossy, `relay.wire`)."""
    packet, fields = make_round(packet_fields, tensors, key, codec=codec, hidden_codec=hidden_codec)
    return packet, seal(key, fields)


def make_round(
    packet_fields: dict,
    tensors: dict[str, torch.Tensor],
    key: bytes,
    *,
    codec: Codec = "raw",
    hidden_codec: TensorCodec | None = None,
) -> tuple[RoundPacket, dict]:
    """`encode_round` but unsealed: the fields that `seal`, or `schemas.groups.seal_group` with other rounds, MACs."""
    metas = {
        name: tensor_meta(t, hidden_codec if name == "hidden" and hidden_codec is not None else codec)
        for name, t in tensors.items()
    }
    packet, header = round_header(packet_fields, metas, key)
    return packet, round_fields(packet, header, tensors)


def round_header(packet_fields: dict, metas: dict[str, TensorMeta], key: bytes) -> tuple[RoundPacket, bytes]:
    """A round's validated header and its JSON, from header fields and its tensors' metas (each naming its codec):
    what `encode_round` seals, made before the tensors' bytes exist (the head builds it while its device computes
    them)."""
    opens = packet_fields.get("start_pos") == 0
    packet = RoundPacket(**packet_fields, tensors=metas, key=key.hex() if opens else None)
    return packet, packet.model_dump_json().encode()


def round_fields(packet: RoundPacket, header: bytes, tensors: dict[str, torch.Tensor]) -> dict[bytes, bytes]:
    """The unsealed stream fields of a round whose header `round_header` made, with these tensors, which must be
    what the header says (PacketError otherwise), each encoded under the codec its header names."""
    if set(tensors) != set(packet.tensors):
        raise PacketError(f"tensors {sorted(tensors)} are not the header's {sorted(packet.tensors)}")
    raws = {}
    for name, t in tensors.items():
        meta, raws[TENSOR_PREFIX + name.encode()] = encode_tensor(t, packet.tensors[name].codec)
        if packet.tensors[name] != meta:
            raise PacketError(f"tensor {name!r} is {meta.dtype}{meta.shape}, its header says otherwise")
    return {HEADER: header, **raws}


def encode_message(msg: BaseModel, key: bytes | None = None) -> dict[bytes, bytes]:
    """Stream fields of a header-only message (close, verdict, error), sealed with the session's key (a
    reply when it is a tail's message); only an echoed error reply goes unsealed (key None)."""
    fields = {HEADER: msg.model_dump_json().encode()}
    if key is None:
        return fields
    return seal(key, fields, reply=isinstance(msg, Verdict | ErrorReply))


class Oversized(PacketError):
    """A packet larger than the cap (its header may still be read, to answer its own head)."""


def _header(fields: dict, max_bytes: int | None, max_header: int) -> bytes:
    if not isinstance(fields, dict) or HEADER not in fields:
        raise PacketError("packet has no header field 'h'")
    total = sum(len(k) + len(v) for k, v in fields.items())
    if max_bytes is not None and total > max_bytes:
        raise Oversized(f"packet of {total} bytes exceeds the cap of {max_bytes}")
    head = fields[HEADER]
    if len(head) > max_header:
        raise PacketError(f"header of {len(head)} bytes exceeds the cap of {max_header}")
    return head


def _check_version(head: bytes) -> None:
    try:
        raw = json.loads(head)
    except ValueError as e:
        raise PacketError(f"header is not JSON: {e}") from None
    except RecursionError:
        raise PacketError("header is not JSON: nested too deeply") from None
    if not isinstance(raw, dict):
        raise PacketError("header is not a JSON object")
    if raw.get("v") != PROTOCOL_VERSION:
        raise PacketError(
            f"unsupported packet version {raw.get('v')!r}: this build speaks relay protocol {PROTOCOL_VERSION}; "
            "run head and tail workers of the same ShardFlow release"
        )


def _validated(adapter: TypeAdapter, head: bytes) -> Any:
    """The header parsed and validated in one pass; where it fails, a header that is not JSON or speaks another
    protocol version says so first (`_check_version`), as a clearer reason than the fields'. (Parsing it once
    more only to read its version came to a third of a tail's checks of a batch.)"""
    try:
        msg = adapter.validate_json(head)
    except ValidationError as e:
        _check_version(head)
        raise PacketError(_validation_message(e)) from None
    if "v" not in msg.model_fields_set:  # the version has a default in the model, but a header must say it
        _check_version(head)
    return msg


def _validation_message(e: ValidationError) -> str:
    parts = [f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors()[:3]]
    return "invalid packet: " + "; ".join(parts)


def decode_head_header(fields: dict, *, caps: RelaySettings = CAPS, capped: bool = True) -> RoundPacket | ClosePacket:
    """Validate one head -> tail entry's header and its fields (tensors declared, a MAC), decoding no tensor:
    the caller checks the MAC (`authentic`) before `round_tensors` touches the bytes. A packet over
    caps.max_packet_bytes raises Oversized (capped=False: no cap, for reading the header of one that is)."""
    head = _header(fields, caps.max_packet_bytes if capped else None, caps.max_header_bytes)
    msg = _validated(_HEAD, head)
    names = msg.tensors if isinstance(msg, RoundPacket) else {}
    expected = {TENSOR_PREFIX + n.encode() for n in names} | {HEADER, MAC}
    if (got := set(fields) - {DIGEST}) != expected:  # DIGEST: a group's part (schemas/groups.py `entry_parts`)
        extra = sorted(k.decode(errors="replace") if isinstance(k, bytes) else str(k) for k in got ^ expected)
        raise PacketError(f"packet fields do not match its header: {extra}")
    return msg


def round_tensors(
    msg: RoundPacket,
    fields: dict,
    *,
    caps: RelaySettings = CAPS,
    device: str | torch.device = "cpu",
    views: frozenset[str] = frozenset(),
) -> dict[str, torch.Tensor]:
    """The tensors of a round whose header `decode_head_header` accepted, and whose MAC its caller checked (each
    within caps.max_tensor_elements, and all of them, decoded, within caps.max_packet_bytes: a compressed round may
    not inflate past what a raw one could hold); those raw and named in `views` as read-only views of the fields'
    bytes (`decode_tensor`)."""
    n = caps.max_tensor_elements
    decoded = sum(meta.nbytes for meta in msg.tensors.values())
    if decoded > caps.max_packet_bytes:
        raise PacketError(
            f"a round's tensors of {decoded} bytes decoded exceed the packet cap of {caps.max_packet_bytes}"
        )
    return {
        name: decode_tensor(
            meta, fields[TENSOR_PREFIX + name.encode()], max_elements=n, device=device, view=name in views
        )
        for name, meta in msg.tensors.items()
    }


def decode_head_message(
    fields: dict, *, caps: RelaySettings = CAPS, device: str | torch.device = "cpu"
) -> tuple[RoundPacket | ClosePacket, dict[str, torch.Tensor]]:
    """Validate and decode one head -> tail stream entry (its MAC unchecked); raise PacketError with a clear
    reason."""
    msg = decode_head_header(fields, caps=caps)
    return msg, round_tensors(msg, fields, caps=caps, device=device) if isinstance(msg, RoundPacket) else {}


def decode_tail_message(fields: dict, *, caps: RelaySettings = CAPS) -> Verdict | ErrorReply:
    """Validate and decode one tail -> head reply (the caller checks its MAC, or its echo)."""
    head = _header(fields, caps.max_header_bytes + 64, caps.max_header_bytes)
    if not set(fields) <= {HEADER, MAC}:
        raise PacketError("a reply holds only a header and a MAC")
    return _validated(_TAIL, head)
