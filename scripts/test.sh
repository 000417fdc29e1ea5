#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite; a skipped or missing test fails the run.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
export SHARDFLOW_STRICT_TESTS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
python -m ruff check .
python -m pytest -q "$@"
