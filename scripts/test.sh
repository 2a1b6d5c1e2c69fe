#!/usr/bin/env bash
# Install everything the tests need and run the whole suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh server demo bench test
# Convert the demo model once up front (cached under ~/.cache/ftransformers) so tests share it.
.venv/bin/python -c "from ftransformers.entrypoints.demo_model import ensure_demo_model; ensure_demo_model()"
# One pytest worker a core (pytest-xdist; FTRANSFORMERS_TEST_WORKERS overrides, 0 runs in this process): most of
# the suite is the Triton interpreter, single-threaded Python, so two cores take it in about half the time.
# `--dist worksteal`: a worker that runs out of tests takes queued ones from the other, so the suite's long tests
# (10-100 s each under the interpreter) do not leave one core idle at the end (2085 s of tests in 1068 s on 2 cores).
workers="${FTRANSFORMERS_TEST_WORKERS:-auto}"
dist=()
[ "$workers" != "0" ] && dist=(--dist worksteal)
set +e
.venv/bin/python -m pytest -n "$workers" "${dist[@]}" "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
    echo "error: pytest collected no tests" >&2
    exit 1
fi
exit "$status"
