"""Coding-agent harnesses: the real Claude Code and Codex CLIs run inside a sandbox against the agent adapters
(slime's `slime.agent.harness`). A harness installs its CLI, writes the CLI's config and runs one episode to an exit
code; the workspace (the task) is the caller's. Not the sandbox (`slime.agent.sandbox`), not the adapters."""

from __future__ import annotations

from slime.agent.harness.claude_code import ClaudeCodeHarness
from slime.agent.harness.codex import CodexHarness
from slime.agent.harness.common import BaseHarness, HarnessContext, install_npm_cli, run_agent

__all__ = ["BaseHarness", "ClaudeCodeHarness", "CodexHarness", "HarnessContext", "install_npm_cli", "run_agent"]
