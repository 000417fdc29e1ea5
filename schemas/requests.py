"""What a user asks for (GenerationRequest) and what they get back (GenerationResult)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas.settings import GenerationSettings

_GEN = GenerationSettings()  # the documented defaults (no environment): the field defaults below

SCHEMA_VERSION = 1

SessionId = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,128}$")]
TokenId = Annotated[int, Field(ge=0, lt=1 << 31)]
FinishReason = Literal["eos", "length", "stop"]
BUILTIN_DRAFTERS = ("model", "ngram", "none")
STREAM_BROKEN_MAX = 512  # characters of GenerationResult.stream_broken
# a value of a plugin drafter's `draft.options` (bounded: any producer can send one)
PluginValue = (
    bool | int | float | Annotated[str, Field(max_length=1024)] | Annotated[list[TokenId], Field(max_length=1 << 16)]
)


class SamplingParams(BaseModel):
    """How tokens are chosen; temperature 0 means greedy. Applied identically to target and draft."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(0.0, ge=0.0, le=100.0, description="0 = greedy decoding.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus mass kept; 1 = off.")
    top_k: int = Field(0, ge=0, description="Most likely tokens kept; 0 = off.")
    seed: int | None = Field(None, ge=0, lt=1 << 63, description="Fixes the random draws.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class DraftSettings(BaseModel):
    """Which drafter proposes tokens and how many per round."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: str = Field(
        "model",
        pattern=r"^[a-z][a-z0-9_]{0,31}$",
        description="'model' uses the head's draft model if it has one, else n-gram; 'ngram' prompt lookup; "
        "'none' no speculation; any other name is a plugin drafter (workers/plugins.py) that the head must have "
        "been started with, else the job fails with the reason.",
    )
    k: int = Field(_GEN.draft_k, ge=0, le=64, description="Draft tokens per round (the most, if adaptive).")
    adaptive: bool = Field(
        True,
        description="Adapt the draft length per generation: transformers' +2/-1 schedule for the first rounds, "
        "then the length with the most expected tokens/s from measured acceptance and round timings.",
    )
    ngram_max: int = Field(_GEN.ngram_max, ge=1, le=16)
    ngram_min: int = Field(_GEN.ngram_min, ge=1, le=16)
    options: dict[Annotated[str, Field(max_length=64)], PluginValue] = Field(
        default_factory=dict, max_length=16, description="A plugin drafter's own settings (it validates them)."
    )

    @model_validator(mode="after")
    def _options_for_plugins(self) -> DraftSettings:
        if self.options and self.kind in BUILTIN_DRAFTERS:
            raise ValueError(f"draft.options are for plugin drafters, not {self.kind!r}")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Literal["system", "user", "assistant"]
    content: str = Field(max_length=1 << 20)


class GenerationRequest(BaseModel):
    """One generation: exactly one of prompt, messages or prompt_ids, plus how to decode it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    v: Literal[1] = SCHEMA_VERSION
    prompt: str | None = Field(None, max_length=1 << 20)
    messages: list[ChatMessage] | None = Field(None, max_length=1024)
    prompt_ids: list[TokenId] | None = Field(None, max_length=1 << 20)
    chat_template: bool | None = Field(
        None, description="Apply the tokenizer's chat template to `prompt`; None = if it has one."
    )
    max_new_tokens: int = Field(_GEN.max_new_tokens, ge=1, le=1 << 20)
    sampling: SamplingParams = SamplingParams()
    stop: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(default_factory=list, max_length=16)
    draft: DraftSettings = DraftSettings()

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerationRequest:
        given = [x for x in (self.prompt, self.messages, self.prompt_ids) if x is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of prompt, messages or prompt_ids")
        if self.prompt is not None and not self.prompt.strip():
            raise ValueError("prompt is empty")
        if self.messages is not None and not self.messages:
            raise ValueError("messages is empty")
        if self.prompt_ids is not None and not self.prompt_ids:
            raise ValueError("prompt_ids is empty")
        if self.draft.ngram_min > self.draft.ngram_max:
            raise ValueError("draft.ngram_min exceeds draft.ngram_max")
        return self


class RoundTimings(BaseModel):
    """Milliseconds spent per stage, summed over a generation's rounds."""

    model_config = ConfigDict(extra="forbid")

    draft_ms: float = 0.0
    head_forward_ms: float = 0.0
    relay_ms: float = 0.0  # the link both ways, Redis, and what the head's I/O threads add
    # parts of relay_ms, timed against wall clocks on both sides (meaningful where they agree, as on one host):
    send_ms: float = 0.0  # from the loop queueing a round to its entry reaching Redis (sealing, the sender, the link)
    tail_prepare_ms: float = 0.0  # the tail decoding and checking the round's batch before its forward
    back_ms: float = 0.0  # from the tail's verdict to the loop taking it (the link, the receiver, the loop's step)
    tail_queue_ms: float = 0.0  # from a round's entry reaching Redis to its tail taking it up (the tail's clock)
    tail_forward_ms: float = 0.0
    verify_ms: float = 0.0
    total_ms: float = 0.0
    head_batch_rounds: int = 0  # rounds in the head's batches that computed this generation's rounds, summed
    tail_batch_rounds: int = 0  # the same for the tail's batches
    # per middle stage along the route (index i: the i-th), the ms it held the rounds (within relay_ms; empty without
    # stages); a stage's own clock, as the tail's numbers are, clamped to each round's wait
    hop_ms: list[float] = Field(default_factory=list)


class GenerationResult(BaseModel):
    """The outcome of one generation, as stored and returned."""

    model_config = ConfigDict(extra="forbid")

    v: Literal[1] = SCHEMA_VERSION
    session_id: SessionId
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    rounds: int
    drafted_tokens: int
    accepted_tokens: int
    mean_accepted: float = Field(description="Draft tokens accepted per round.")
    tokens_per_round: float = Field(description="Tokens committed per round (accepted + 1).")
    tokens_per_s: float
    timings: RoundTimings
    resumed_tokens: int = Field(0, description="Tokens taken from a checkpoint (a retried job resumed).")
    replays: int = Field(0, description="Times the session was replayed onto a live tail (tail crash).")
    stream_broken: str | None = Field(
        None,
        max_length=STREAM_BROKEN_MAX,
        description="Why the job's token stream stopped being written, if it did (another client wrote or "
        "type-broke it): its text there is incomplete, this result's is whole. None: the stream holds it all.",
    )
