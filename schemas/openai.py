"""OpenAI's formats as ShardFlow speaks them: Batch API input lines, chat / text completion request bodies (the
Batch API's and `shardflow serve`'s), and the objects returned (completions, stream chunks, batch output
lines, errors).

    line = BatchLine.model_validate_json(text)     # {"custom_id", "method": "POST", "url", "body"}
    req = line.generation(settings.generation)      # a GenerationRequest (defaults: the process's settings)
    out = output_line(tag, job_id, result, error)   # {"id", "custom_id", "response": {...}, "error"}

Request bodies are validated like every other input (unknown fields refused, `n` only 1, types strict:
`max_tokens` an integer, never `true` or `"8"`); a body becomes one GenerationRequest. OpenAI's defaults
apply (temperature 1, top_p 1); max_tokens defaults to the process's generation.max_new_tokens. The tag a job keeps
(`JobTag`: custom_id, endpoint, model, stop sequences) is written by producers, so it is validated again
wherever it is read.

Stop sequences follow OpenAI's rule in what is returned here (completions, stream chunks, Batch output lines):
the matched stop sequence is left out (`visible_text`). The job's own GenerationResult keeps ShardFlow's rule:
its text and token ids run up to and including the token that completed the stop string.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from schemas.requests import ChatMessage, GenerationRequest, SamplingParams
from schemas.settings import GenerationSettings

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
Endpoint = Literal["/v1/chat/completions", "/v1/completions"]
CustomId = Annotated[str, Field(min_length=1, max_length=64)]
Stop = Annotated[str, Field(min_length=1, max_length=256)]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    type: Literal["text"]
    text: str = Field(max_length=1 << 20)


class MessageIn(BaseModel):
    """A chat message as OpenAI sends it: content a string or text parts; 'developer' is a system message."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[str, Field(max_length=1 << 20)] | Annotated[list[TextPart], Field(max_length=64)]
    name: str | None = Field(None, max_length=256)

    def plain(self) -> ChatMessage:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return ChatMessage(role="system" if self.role == "developer" else self.role, content=text)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    include_usage: bool = False


class _Body(BaseModel):
    """What chat and text completion bodies share (types strict: JSON's integers, numbers, booleans as sent)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(None, ge=1, le=1 << 20)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=1 << 63)
    stop: Stop | Annotated[list[Stop], Field(max_length=16)] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int | None) -> int | None:
        if n not in (None, 1):
            raise ValueError("only n = 1 is supported (one choice per request)")
        return n

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def tag(self, url: str, custom_id: str | None = None) -> JobTag:
        """What the job keeps of this body: the endpoint, the model named, the stop sequences."""
        return JobTag(custom_id=custom_id, url=url, model=self.model, stop=self.stops())  # type: ignore[arg-type]

    def _common(self, max_new: int | None, defaults: GenerationSettings) -> dict[str, Any]:
        stop = self.stops()
        temperature = 1.0 if self.temperature is None else self.temperature  # OpenAI's default
        sampling = SamplingParams(temperature=temperature, top_p=self.top_p or 1.0, seed=self.seed)
        return {"max_new_tokens": max_new or defaults.max_new_tokens, "sampling": sampling, "stop": stop}


class ChatBody(_Body):
    messages: list[MessageIn] = Field(min_length=1, max_length=1024)
    max_completion_tokens: int | None = Field(None, ge=1, le=1 << 20)

    def generation(self, defaults: GenerationSettings) -> GenerationRequest:
        """The body as a GenerationRequest; `defaults`: the process's generation settings (max_new_tokens)."""
        common = self._common(self.max_completion_tokens or self.max_tokens, defaults)
        return GenerationRequest(messages=[m.plain() for m in self.messages], **common)


class CompletionBody(_Body):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)]

    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    def generation(self, defaults: GenerationSettings) -> GenerationRequest:
        """The body as a GenerationRequest; `defaults`: the process's generation settings (max_new_tokens)."""
        common = self._common(self.max_tokens, defaults)
        return GenerationRequest(prompt=self.prompt_text(), chat_template=False, **common)


def body_for(url: str, body: Any) -> ChatBody | CompletionBody:
    """The validated body of a request to `url` (pydantic's ValidationError if it is not one)."""
    return (ChatBody if url == CHAT else CompletionBody).model_validate(body)


class BatchLine(BaseModel):
    """One line of a Batch API input file."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    custom_id: CustomId
    method: Literal["POST"]
    url: Endpoint
    body: dict[str, Any]

    @model_validator(mode="after")
    def _body(self) -> BatchLine:
        if body_for(self.url, self.body).stream:
            raise ValueError("body.stream: a batch request is not streamed")
        return self

    def generation(self, defaults: GenerationSettings) -> GenerationRequest:
        """The line's body as a GenerationRequest (`defaults`: the process's generation settings)."""
        return body_for(self.url, self.body).generation(defaults)

    def tag(self) -> JobTag:
        return body_for(self.url, self.body).tag(self.url, self.custom_id)


class JobTag(BaseModel):
    """What a job keeps of the OpenAI request it came from (in its meta, under `openai`)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    custom_id: CustomId | None = None
    url: Endpoint = CHAT
    model: str = Field("shardflow", min_length=1, max_length=256)
    stop: list[Stop] = Field(default_factory=list, max_length=16)  # left out of the text returned


def visible_text(text: str, stops: Sequence[str], reason: str | None) -> str:
    """A result's text as OpenAI returns it: a generation that ended on a stop string (`reason` "stop") without
    the stop string. ShardFlow ends at the first token after which the text ends with a stop string, which may
    have begun in the prompt: then the whole generated text is the end of the stop string, and nothing is left.
    With several matching, the longest (the earliest to begin) goes."""
    if reason != "stop" or not stops:
        return text
    cuts = [len(text) - len(s) for s in stops if text.endswith(s)]
    if cuts:
        return text[: min(cuts)]
    return "" if any(s.endswith(text) for s in stops) else text


def finish_reason(reason: str | None) -> str | None:
    """ShardFlow's finish reason as OpenAI's: eos and stop strings are 'stop'."""
    return None if reason is None else "length" if reason == "length" else "stop"


def usage(result: dict) -> dict[str, int]:
    p, c = int(result.get("prompt_tokens", 0)), int(result.get("completion_tokens", 0))
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _envelope(tag: JobTag, job_id: str, created: int, chunked: bool) -> dict[str, Any]:
    """What every completion object and stream chunk opens with: id, object, created, model."""
    chat = tag.url == CHAT
    kind = ("chat.completion.chunk" if chunked else "chat.completion") if chat else "text_completion"
    return {"id": f"{'chatcmpl-' if chat else 'cmpl-'}{job_id}", "object": kind, "created": created, "model": tag.model}


def completion(tag: JobTag, job_id: str, result: dict, created: int | None = None) -> dict:
    """The chat.completion or text_completion object of a finished job's result."""
    created = int(time.time()) if created is None else created
    reason = finish_reason(result.get("finish_reason"))
    text = visible_text(result.get("text", ""), tag.stop, result.get("finish_reason"))
    if tag.url == CHAT:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        choice |= {"logprobs": None, "finish_reason": reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
    return {**_envelope(tag, job_id, created, False), "choices": [choice], "usage": usage(result)}


def chunk(tag: JobTag, job_id: str, created: int, text: str | None, reason: str | None, role: bool = False) -> dict:
    """One server-sent event's object of a streamed completion (text None: an empty delta)."""
    if tag.url == CHAT:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
    return {**_envelope(tag, job_id, created, True), "choices": [choice]}


def usage_chunk(tag: JobTag, job_id: str, created: int, result: dict) -> dict:
    """The last chunk of a stream asked with stream_options.include_usage: no choices, the usage."""
    return {**_envelope(tag, job_id, created, True), "choices": [], "usage": usage(result)}


def error(message: str, kind: str = "invalid_request_error", code: str | None = None, param: str | None = None):
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def status_of(job_error: str | None) -> int:
    """The HTTP status a failed job's output line carries: 400 for a request that can never run, else 500."""
    invalid = ("InvalidRequest", "NonFiniteError", "not available on this worker", "cannot fit", "exceeds")
    return 400 if job_error and any(s in job_error for s in invalid) else 500


CANCELLED_LINE_ERROR = {"code": "batch_cancelled", "message": "This request was cancelled before it finished."}
SERVER_ERROR = "the request failed on the server (its job id is the request_id; `shardflow status` shows why)"


def output_line(
    tag: JobTag,
    job_id: str,
    result: dict | None,
    job_error: str | None,
    *,
    created: int | None = None,
    cancelled: bool = False,
    detail: bool = True,
) -> dict:
    """A Batch API output line for a job that ended: its completion; a cancelled request in OpenAI's shape (no
    response, error code `batch_cancelled`); or its error with a 4xx/5xx status. `created` stamps the completion
    (default: now); `detail` False words a 5xx error without the job's own error text (for `shardflow serve`)."""
    if result is not None:
        body = completion(tag, job_id, result, created)
        response = {"status_code": 200, "request_id": job_id, "body": body}
        return {"id": f"batch_req_{job_id}", "custom_id": tag.custom_id, "response": response, "error": None}
    if cancelled:
        error_ = dict(CANCELLED_LINE_ERROR)
        return {"id": f"batch_req_{job_id}", "custom_id": tag.custom_id, "response": None, "error": error_}
    status = status_of(job_error)
    message = job_error or "the request failed"
    if status >= 500 and not detail:
        message = SERVER_ERROR
    kind = "invalid_request_error" if status == 400 else "server_error"
    response = {"status_code": status, "request_id": job_id, "body": error(message, kind)}
    return {
        "id": f"batch_req_{job_id}",
        "custom_id": tag.custom_id,
        "response": response,
        "error": {"code": kind, "message": message},
    }
