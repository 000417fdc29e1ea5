#!/usr/bin/env python3
"""Render deploy/users.acl.template into a Redis ACL file that holds no password in clear.

    python3 deploy/render_acl.py --env-file .env -o deploy/users.acl

- `>${VAR}` becomes `#<sha256 hex of $VAR>`: Redis stores and compares SHA-256 hashes, so the file
  is not a credential (use long random passwords: `openssl rand -hex 24`; shorter than 16 characters
  is refused).
- `${SHARDFLOW_REDIS__PREFIX}` becomes the key prefix (default `shardflow`, as in schemas/settings.py).
- `#` comment lines and blank lines are dropped (Redis ACL files allow none); an indented line
  continues the user line above it.
- Named workers: `--heads NAME,...` (or SHARDFLOW_ACL_HEADS) renders the `user head-${HEAD}` block once per name,
  `${HEAD}` as the name and `${HEAD_VAR}` as its variable form (upper-cased, '-' as '_': the password is
  REDIS_HEAD_<NAME>_PASSWORD); `--tails` (SHARDFLOW_ACL_TAILS) likewise for `user tail-${TAIL}`, `--stages`
  (SHARDFLOW_ACL_STAGES) for `user stage-${STAGE}`. Names are 1-64 of A-Z a-z 0-9 _ - (no '.': a head's reply streams
  are `reply:head.NAME.*`, and a dot would let one name's pattern match another's); a stage's starts with a letter or
  '_' (its stream `stage:NAME:requests` is then never a layer range's `stage:A-B:requests`, whose pattern is
  `stage:[0-9]*`). Without names those blocks are dropped. A shared role user (`head`, `tail`) whose password is
  unset is dropped when named users of its role are rendered, and an error otherwise; the shared `stage` user (middle
  stages, which two-worker deployments do not run) is rendered only where REDIS_STAGE_PASSWORD is set.

Values come from the environment, then from --env-file (KEY=VALUE lines, as compose reads .env).
Standard library only, so it runs anywhere (compose runs it in a python:3.11-slim container).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

TEMPLATE = Path(__file__).with_name("users.acl.template")
DEFAULT_PREFIX = "shardflow"
MIN_PASSWORD_LENGTH = 16
PASSWORD = re.compile(r">\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
PREFIX = "${SHARDFLOW_REDIS__PREFIX}"
SAFE_PREFIX = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")  # no glob characters, no spaces
WORKER_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # a named worker user's name: no dots, no glob characters
STAGE_NAME = re.compile(r"^[A-Za-z_]")  # a stage's: never a layer range `A-B` (the ranges' streams are stage:[0-9]*)
NAMED = {"HEAD": "head", "TAIL": "tail", "STAGE": "stage"}  # placeholder -> the shared role its named users replace
OPTIONAL = {"stage"}  # shared role users rendered only where their password is set (no error without it)


class RenderError(ValueError):
    """The template or a value cannot make a valid ACL file."""


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines (blank lines, `#` comments and `export ` ignored; one level of quotes stripped)."""
    out: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, value = line.removeprefix("export ").split("=", 1)
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        out[key.strip()] = value
    return out


def user_lines(template: str) -> list[str]:
    """One line per user: comments and blanks dropped, indented continuation lines joined."""
    lines: list[str] = []
    for raw in template.splitlines():
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        if raw[0].isspace():
            if not lines:
                raise RenderError(f"continuation line before any user line: {raw.strip()!r}")
            lines[-1] += " " + " ".join(raw.split())
        else:
            lines.append(" ".join(raw.split()))
    for line in lines:
        if not line.startswith("user "):
            raise RenderError(f"not a user line: {line[:60]!r}")
    return lines


def _hashed(values: Mapping[str, str], min_length: int) -> Callable[[re.Match[str]], str]:
    def sub(m: re.Match[str]) -> str:
        name = m.group(1)
        value = values.get(name, "")
        if not value:
            raise RenderError(f"{name} is not set")
        if len(value) < min_length:
            raise RenderError(f"{name} is shorter than {min_length} characters")
        return "#" + hashlib.sha256(value.encode()).hexdigest()

    return sub


def worker_names(values: Mapping[str, str], placeholder: str) -> list[str]:
    """The named workers of one role (`SHARDFLOW_ACL_HEADS` / `_TAILS` / `_STAGES`, comma-separated), checked."""
    names = [n.strip() for n in values.get(f"SHARDFLOW_ACL_{placeholder}S", "").split(",") if n.strip()]
    for name in names:
        if not WORKER_NAME.match(name):
            raise RenderError(f"worker name {name!r} must be 1-64 of A-Z a-z 0-9 _ -")
        if placeholder == "STAGE" and not STAGE_NAME.match(name):
            raise RenderError(f"stage name {name!r} must start with a letter or '_' (stage:A-B:requests is a range's)")
    if len(set(names)) != len(names):
        raise RenderError(f"a {NAMED[placeholder]} name is listed twice: {','.join(names)}")
    return names


def _expanded(line: str, values: Mapping[str, str]) -> list[str]:
    """A template user line, once per named worker where it is a named block (none without names)."""
    for placeholder in NAMED:
        if f"${{{placeholder}}}" in line:
            return [
                line.replace(f"${{{placeholder}_VAR}}", name.upper().replace("-", "_")).replace(
                    f"${{{placeholder}}}", name
                )
                for name in worker_names(values, placeholder)
            ]
    return [line]


def render(template: str, values: Mapping[str, str], *, min_length: int = MIN_PASSWORD_LENGTH) -> str:
    """The ACL file text for `template` with passwords from `values` (hashed), the key prefix and the named
    workers' users (see the module docstring)."""
    prefix = values.get("SHARDFLOW_REDIS__PREFIX") or DEFAULT_PREFIX
    if not SAFE_PREFIX.match(prefix):
        raise RenderError(f"SHARDFLOW_REDIS__PREFIX {prefix!r} must be 1-64 of A-Z a-z 0-9 _ . : -")
    optional = OPTIONAL | {role for placeholder, role in NAMED.items() if worker_names(values, placeholder)}
    out = []
    for line in (x for raw in user_lines(template) for x in _expanded(raw, values)):
        user = line.split()[1]
        if user in optional and not values.get(f"REDIS_{user.upper()}_PASSWORD"):
            continue  # the shared user of a role whose workers all have their own
        line = PASSWORD.sub(_hashed(values, min_length), line).replace(PREFIX, prefix)
        if "${" in line or " >" in line:
            raise RenderError(f"unrendered placeholder or clear password in: {line.split()[1]}")
        out.append(line)
    return "\n".join(out) + "\n"


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` in one step, mode 0644 (the redis-server user must read it; it holds only hashes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--template", type=Path, default=TEMPLATE, help="ACL template (default: %(default)s)")
    ap.add_argument("--env-file", type=Path, default=None, help="KEY=VALUE file read after the environment")
    ap.add_argument("-o", "--out", default="-", help="output file, - for stdout (default)")
    ap.add_argument("--min-length", type=int, default=MIN_PASSWORD_LENGTH, help="shortest password accepted")
    ap.add_argument("--heads", default=None, help="named heads, comma-separated (SHARDFLOW_ACL_HEADS): a user each")
    ap.add_argument("--tails", default=None, help="named tails, comma-separated (SHARDFLOW_ACL_TAILS): a user each")
    ap.add_argument("--stages", default=None, help="named stages, comma-separated (SHARDFLOW_ACL_STAGES): a user each")
    args = ap.parse_args(argv)
    values = read_env_file(args.env_file) if args.env_file else {}
    values |= {k: v for k, v in os.environ.items() if v}
    for placeholder, given in (("HEAD", args.heads), ("TAIL", args.tails), ("STAGE", args.stages)):
        if given is not None:
            values[f"SHARDFLOW_ACL_{placeholder}S"] = given
    try:
        text = render(args.template.read_text(), values, min_length=args.min_length)
    except (RenderError, OSError) as e:
        print(f"render_acl: {e}", file=sys.stderr)
        return 2
    if args.out == "-":
        sys.stdout.write(text)
    else:
        write_atomic(Path(args.out), text)
        print(f"render_acl: wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
