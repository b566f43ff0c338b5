#!/usr/bin/env bash
# Install (if needed) and run the test suite: unit + integration (real Ray, real CPU vLLM engine,
# embedded model). Slow suites are opt-in: scripts/test.sh -m slow. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
exec .venv/bin/python -m pytest "$@"
