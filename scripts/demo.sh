#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run a split speculative generation end to end on this machine:
# embedded Redis + a tail worker process + the head, talking only through Redis.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
shardflow local "$@"
