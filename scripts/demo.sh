#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the demo end to end on this machine: an embedded Redis, a tail and a
# head worker process with SmolLM2-135M-Instruct, a few prompts enqueued as jobs, answers streamed.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
shardflow demo "$@"
