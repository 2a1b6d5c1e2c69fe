#!/usr/bin/env bash
# Install everything the tests need and run the whole suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh server demo bench test
# Convert the demo model once up front (cached under ~/.cache/ftransformers) so tests share it.
.venv/bin/python -c "from ftransformers.entrypoints.demo_model import ensure_demo_model; ensure_demo_model()"
set +e
.venv/bin/python -m pytest "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
    echo "error: pytest collected no tests" >&2
    exit 1
fi
exit "$status"
