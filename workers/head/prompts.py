"""Turning a GenerationRequest into prompt token ids: shared by head workers and the producer's checks."""

from __future__ import annotations

from schemas.errors import InvalidRequest
from schemas.requests import GenerationRequest


def encode_prompt(tokenizer: object, req: GenerationRequest, vocab_size: int, context_length: int | None) -> list[int]:
    """Token ids of the request's prompt (chat template for messages, and for prompts if asked or if
    the tokenizer has one); raises InvalidRequest if it is empty or cannot fit the model."""
    tok = tokenizer
    if req.prompt_ids is not None:
        ids = list(req.prompt_ids)
    else:
        has_template = bool(getattr(tok, "chat_template", None))
        wanted = req.chat_template if req.chat_template is not None else has_template
        use_template = req.messages is not None or wanted
        if use_template and not has_template:
            raise InvalidRequest("this model's tokenizer has no chat template")
        if use_template:
            msgs = [m.model_dump() for m in req.messages] if req.messages else [{"role": "user", "content": req.prompt}]
            text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)  # type: ignore[attr-defined]
            ids = tok.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]
        else:
            ids = tok.encode(req.prompt)  # type: ignore[attr-defined]
    if not ids:
        raise InvalidRequest("the prompt encodes to no tokens")
    if max(ids) >= vocab_size:
        raise InvalidRequest(f"prompt token id {max(ids)} is outside the vocabulary of {vocab_size}")
    if context_length and len(ids) + req.max_new_tokens > context_length:
        raise InvalidRequest(
            f"prompt of {len(ids)} tokens + max_new_tokens {req.max_new_tokens} exceeds the model's context of "
            f"{context_length} tokens"
        )
    return ids
