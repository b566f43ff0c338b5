#!/usr/bin/env bash
# Install (if needed) and start pdserve on the embedded model. Extra flags go to `pdserve serve`,
# e.g. scripts/serve.sh --port 8001 --replicas 2
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
exec .venv/bin/pdserve serve "$@"
