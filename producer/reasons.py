"""Validation errors in plain words: what `shardflow serve` answers and `shardflow enqueue` prints for a bad body
or line, without pydantic's internals (union members such as `constrained-str` or `list[TextPart]`, class names,
the input echoed back).

    plain_reason(e)   # "messages[0].content: over the limit of 1048576 characters; max_tokens: must be an integer"
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

FIELD = re.compile(r"[a-z_][a-z0-9_]*")
TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})
KINDS = {
    "string_type": "a string",
    "list_type": "a list",
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "dict_type": "a JSON object",
    "model_type": "a JSON object",
    "model_attributes_type": "a JSON object",
    "none_required": "null",
}
MOST_PROBLEMS, LONGEST_NAME = 3, 64


def plain_reason(e: ValidationError) -> str:
    """The first few problems of a validation error, each `place: what is wrong`, as one line."""
    problems: list[str] = []
    for place, words in _problems(e.errors(include_url=False, include_input=False)):
        line = f"{place}: {words}" if place else words
        if line not in problems:
            problems.append(line)
        if len(problems) == MOST_PROBLEMS:
            break
    return "; ".join(problems) or "the input is not valid"


def _problems(errors: list[Any]) -> list[tuple[str, str]]:
    """(place, words) per problem; the errors of one union's members (a field that may be a string or a list)
    become one: the member that got furthest, or 'must be a string or a list' where none matched."""
    unions: dict[tuple, list[tuple[tuple, dict]]] = {}
    order: list[tuple] = []
    for err in errors:
        loc = tuple(err.get("loc", ()))
        cut = next((i for i, part in enumerate(loc) if _is_tag(part)), None)
        key = loc if cut is None else ("union", *loc[:cut])
        if key not in unions:
            unions[key], _ = [], order.append(key)
        unions[key].append((loc if cut is None else loc[cut + 1 :], err))
    out = []
    for key in order:
        members = unions[key]
        if key[:1] != ("union",):
            out += [(_place(loc), _words(err)) for loc, err in members]
            continue
        base = key[1:]
        deeper = [(rest, err) for rest, err in members if rest or not str(err.get("type", "")).endswith("_type")]
        if deeper:
            rest, err = deeper[0]
            out.append((_place(base + tuple(p for p in rest if not _is_tag(p))), _words(err)))
        else:
            kinds = list(dict.fromkeys(KINDS.get(str(err.get("type")), "another type") for _, err in members))
            out.append((_place(base), "must be " + " or ".join(kinds)))
    return out


def _is_tag(part: object) -> bool:
    """A union member's name pydantic puts in an error's location (not a field name or an index)."""
    return isinstance(part, str) and (part in TYPE_TAGS or not FIELD.fullmatch(part))


def _place(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            name = str(part)[:LONGEST_NAME]
            out += f".{name}" if out else name
    return out


def _words(err: dict) -> str:
    kind, ctx = str(err.get("type", "")), err.get("ctx") or {}
    if kind in KINDS:
        return f"must be {KINDS[kind]}"
    if kind == "extra_forbidden":
        return "not a parameter this server takes"
    if kind == "missing":
        return "required"
    if kind in ("string_too_long", "too_long"):
        unit = "characters" if kind == "string_too_long" else "items"
        return f"over the limit of {ctx.get('max_length')} {unit}"
    if kind in ("string_too_short", "too_short"):
        least = ctx.get("min_length")
        unit = "characters" if kind == "string_too_short" else "items"
        return "must not be empty" if least == 1 else f"fewer than {least} {unit}"
    if kind == "literal_error":
        return f"must be {ctx.get('expected')}"
    msg = str(err.get("msg", "not valid")).removeprefix("Value error, ")
    for said in ("Input should be", "String should", "List should", "Value should"):
        msg = msg.replace(said, "must be" if said == "Input should be" else "must")
    return msg
