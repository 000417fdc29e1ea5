"""Reading prompts for `shardflow enqueue`: arguments, a text file (one prompt per line), a JSONL file
(one request per line, with per-line parameters; or OpenAI Batch API lines, `{"custom_id", "method",
"url", "body"}`, whose bodies carry their own parameters), or stdin (`-`). Every line is validated; errors
carry their line number, and any error means nothing is enqueued."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from producer.reasons import plain_reason
from schemas.errors import InvalidRequest
from schemas.openai import BatchLine, JobTag
from schemas.requests import GenerationRequest
from schemas.settings import GenerationSettings

BATCH_KEYS = {"custom_id", "method", "url", "body"}


@dataclass
class Parsed:
    requests: list[GenerationRequest]
    sources: list[str]  # "argument 2", "line 7", ... per request
    errors: list[str]
    tags: list[JobTag | None] = field(default_factory=list)  # per request: its Batch API line's, if any


def pydantic_reason(e: ValidationError) -> str:
    """The first few problems of a pydantic error, as one line in plain words (producer/reasons.py)."""
    return plain_reason(e)


def _merge(defaults: dict, line: dict) -> dict:
    out = {**defaults, **{k: v for k, v in line.items() if k not in ("sampling", "draft")}}
    for nested in ("sampling", "draft"):
        out[nested] = {**defaults.get(nested, {}), **line.get(nested, {})}
    for k in ("temperature", "top_p", "top_k", "seed"):  # flat sampling keys are accepted on a line too
        if k in line:
            out["sampling"][k] = out.pop(k)
    return out


def _looks_jsonl(path: str, lines: list[str]) -> bool:
    if path.endswith((".jsonl", ".ndjson")):
        return True
    filled = [ln for ln in lines if ln.strip()]
    return bool(filled) and all(ln.lstrip().startswith("{") for ln in filled)


def _read_text(file: str) -> str:
    """The text of a prompts file, or of stdin for `-`: UTF-8 (a byte-order mark is dropped), whatever the
    locale; anything else (a binary or Latin-1 file) is an InvalidRequest naming the first bad byte."""
    name = "stdin" if file == "-" else file
    try:
        if file != "-":
            data = Path(file).read_bytes()
        elif hasattr(sys.stdin, "buffer"):
            data = sys.stdin.buffer.read()
        else:  # a text-only stand-in for stdin (tests): already decoded
            return sys.stdin.read()
    except OSError as e:
        raise InvalidRequest(f"cannot read {name}: {e.strerror or e}") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise InvalidRequest(
            f"{name} is not UTF-8 text (byte 0x{data[e.start]:02x} on line {line}); save it as UTF-8"
        ) from None


def read_prompts(args: list[str], file: str | None, defaults: dict, generation: GenerationSettings) -> Parsed:
    """Build requests from prompt arguments and/or a file; collect every error with its place. `defaults`: the
    request fields of the command's options; `generation`: the process's settings, for Batch API lines."""
    items: list[tuple[str, dict | str | None, str | None]] = []  # (where, data, parse error) in input order
    for i, a in enumerate(args, 1):
        if a == "-":
            file = "-"
        else:
            items.append((f"argument {i}", a, None))
    if file is not None:
        lines = _read_text(file).splitlines()
        items += _line_items(lines, _looks_jsonl(file, lines))
    return _parse_items(items, defaults, generation)


def read_jsonl_text(text: str, generation: GenerationSettings) -> Parsed:
    """Requests from the text of a JSONL file (an uploaded Batch API input file), as `read_prompts` reads one."""
    return _parse_items(_line_items(text.splitlines(), True), {}, generation)


def _line_items(lines: list[str], jsonl: bool) -> list[tuple[str, dict | str | None, str | None]]:
    items: list[tuple[str, dict | str | None, str | None]] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if not jsonl:
            items.append((f"line {n}", line, None))
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            items.append((f"line {n}", None, f"invalid JSON: {e.msg}"))
            continue
        except RecursionError:  # nested thousands of levels deep
            items.append((f"line {n}", None, "invalid JSON: nested too deeply"))
            continue
        items.append(
            (f"line {n}", obj, None) if isinstance(obj, dict) else (f"line {n}", None, "expected a JSON object")
        )
    return items


def _parse_items(
    items: list[tuple[str, dict | str | None, str | None]], defaults: dict, generation: GenerationSettings
) -> Parsed:
    out = Parsed([], [], [])
    custom_ids: dict[str, str] = {}
    for where, item, problem in items:
        if item is None:
            out.errors.append(f"{where}: {problem}")
            continue
        try:
            if isinstance(item, dict) and BATCH_KEYS & item.keys():  # a Batch API line
                line = BatchLine.model_validate(item)
                req, tag = line.generation(generation), line.tag()
                if line.custom_id in custom_ids:
                    out.errors.append(f"{where}: custom_id {line.custom_id!r} already on {custom_ids[line.custom_id]}")
                    continue
                custom_ids[line.custom_id] = where
            else:
                req, tag = GenerationRequest.model_validate(_merge(defaults, _as_dict(item))), None
        except ValidationError as e:
            out.errors.append(f"{where}: {pydantic_reason(e)}")
            continue
        out.requests.append(req)
        out.sources.append(where)
        out.tags.append(tag)
    if not items and not out.errors:
        out.errors.append("no prompts given (arguments, --file PATH, or - for stdin)")
    return out


def _as_dict(item: dict | str) -> dict:
    return item if isinstance(item, dict) else {"prompt": item}
