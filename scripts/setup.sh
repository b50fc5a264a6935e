#!/usr/bin/env bash
# One-command setup: a virtual environment in .venv with slime's dependencies (CPU torch unless torch is there).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip >/dev/null 2>&1 || true
# torch first and pinned: an unpinned `torch` requirement would pull a multi-GB CUDA build.
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  $PIP install -q "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
fi
$PIP install -q -r requirements.txt -r requirements-test.txt 2>&1 | grep -v "^WARNING: Location" || true
# Disk delta weight sync (--update-weight-mode delta): slime's format compresses with zstd and checks xxh3-128.
$PIP install -q "xxhash==4.1.0" "zstandard==0.25.0" 2>&1 | grep -v "^WARNING: Location" || true
# megatron-core for --train-backend megatron: 0.16.1 is the newest release for Python 3.11 (0.17+ need 3.12); its
# cp311 and cp312 wheels need only torch, numpy and packaging (no Transformer Engine or Apex: local fallbacks).
$PIP install -q "megatron-core==0.16.1" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import torch, transformers, ray, sglang_router, math_verify, megatron.core, xxhash, zstandard, orjson" 
echo "setup ok: $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)')"
