#!/usr/bin/env bash
# One-command setup: a virtual environment in .venv with slime and everything its tests, linter and docs need
# (`pip install -e ".[dev]"`), on CPU torch unless a torch is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip >/dev/null 2>&1 || true
# torch first and pinned: pyproject's `torch>=2.6` with no torch present would pull a multi-GB CUDA build.
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  $PIP install -q "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
fi
$PIP install -q -e ".[dev]" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import torch, transformers, ray, sglang_router, math_verify, megatron.core, xxhash, zstandard, orjson, openai, anthropic"
# The coding-agent CLIs (Claude Code, Codex) at pinned versions, for the local-sandbox agent runs (which need root).
if [ "$(id -u)" = 0 ] && ! command -v npm >/dev/null 2>&1 && [ -z "${SLIME_SKIP_AGENT_CLIS:-}" ] &&
   command -v apt-get >/dev/null 2>&1; then  # a fresh Debian machine: node and npm from its packages
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm) >/dev/null 2>&1 ||
    echo "note: nodejs/npm did not install; the coding-agent CLI tests will skip"
fi
if [ "$(id -u)" = 0 ] && command -v npm >/dev/null 2>&1 && [ -z "${SLIME_SKIP_AGENT_CLIS:-}" ]; then
  bash scripts/setup_agent_clis.sh >/dev/null || echo "note: the agent CLIs did not install (scripts/setup_agent_clis.sh)"
fi
echo "setup ok: $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)')"
