#!/usr/bin/env bash
# Install what the server needs and start it on the built-in demo model (SmolLM2-135M-Instruct).
# Extra flags pass through: scripts/serve_demo.sh --port 8002
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh server demo
exec .venv/bin/ftransformers serve "$@"
