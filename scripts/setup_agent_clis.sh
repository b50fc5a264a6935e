#!/usr/bin/env bash
# Install the coding-agent CLIs the harnesses run (slime.agent.harness), at pinned versions, into one folder:
#   bash scripts/setup_agent_clis.sh [DIR]        (default: $SLIME_AGENT_CLI_DIR, else /opt/slime-agent-clis)
# DIR must be readable by every user: the local sandbox mounts it read-only for its unprivileged ids (a folder under
# /root, mode 700, is not).
# npm pulls each CLI's per-platform package too (it carries the native binary); nothing else is downloaded.
# Afterwards DIR/node_modules/.bin/{claude,codex} exist; the local sandbox mounts DIR read-only and runs them.
set -euo pipefail

CLAUDE_CODE_VERSION="${CLAUDE_CODE_VERSION:-2.1.197}"
CODEX_VERSION="${CODEX_VERSION:-0.171.0}"
DIR="${1:-${SLIME_AGENT_CLI_DIR:-/opt/slime-agent-clis}}"

command -v npm >/dev/null || { echo "npm is not installed (apt-get install nodejs npm, node >= 18)" >&2; exit 1; }
mkdir -p "$DIR"
chmod 755 "$DIR"
cd "$DIR"
[ -f package.json ] || echo '{"name": "slime-agent-clis", "private": true}' > package.json
npm install --no-audit --no-fund --save-exact \
  "@anthropic-ai/claude-code@${CLAUDE_CODE_VERSION}" "@openai/codex@${CODEX_VERSION}"
"$DIR/node_modules/.bin/claude" --version
"$DIR/node_modules/.bin/codex" --version
echo "export SLIME_AGENT_CLI_DIR=$DIR"
