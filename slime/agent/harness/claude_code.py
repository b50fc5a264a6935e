"""Claude Code (`claude -p`) as a harness (slime's `ClaudeCodeHarness`).

The CLI talks Anthropic Messages to the adapter: `ANTHROPIC_BASE_URL` = the adapter (no /v1), `ANTHROPIC_AUTH_TOKEN`
= the session id (sent as `Authorization: Bearer`). It runs as the non-root `agent` user, which lets
`--permission-mode bypassPermissions` start (as root it refuses unless IS_SANDBOX=1). The outside hosts it would
dial are switched off by `CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1` (and autoupdate / telemetry by theirs);
`CLAUDE_CODE_MAX_RETRIES` bounds its retries against a failing adapter (unbounded, it backs off for minutes).

Host environment: `SLIME_AGENT_CC_BIN` (the CLI inside the sandbox, default /usr/local/bin/claude),
`SLIME_AGENT_NODE_TARBALL` + `SLIME_AGENT_CC_TARBALL` (install from host tarballs; unset: the CLI must already be at
SLIME_AGENT_CC_BIN, as in the local sandbox with scripts/setup_agent_clis.sh), `SLIME_AGENT_CC_EXTRA_ARGS` (appended
to the command, e.g. `--tools Bash,Read,Edit,Write` for a short system prompt), `SLIME_AGENT_CC_EXTRA_ENVS` (a JSON
object merged last into the CLI's environment).
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

from slime.agent.harness.common import BaseHarness, HarnessContext, install_npm_cli, run_agent
from slime.agent.sandbox import Sandbox


class ClaudeCodeHarness(BaseHarness):
    name = "claude_code"

    bin_env = "SLIME_AGENT_CC_BIN"
    default_bin = "/usr/local/bin/claude"
    node_tarball_env = "SLIME_AGENT_NODE_TARBALL"
    cli_tarball_env = "SLIME_AGENT_CC_TARBALL"
    extra_args_env = "SLIME_AGENT_CC_EXTRA_ARGS"
    extra_envs_env = "SLIME_AGENT_CC_EXTRA_ENVS"

    launch_flags = ("--permission-mode bypassPermissions --output-format stream-json --include-partial-messages "
                    "--include-hook-events --verbose")
    static_env = {
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "CLAUDE_CODE_DISABLE_EXPERIMENTAL_BETAS": "1",
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_TELEMETRY": "1",
        "CLAUDE_CODE_MAX_RETRIES": "2",
    }

    @property
    def cli(self) -> str:
        return os.environ.get(self.bin_env) or self.default_bin

    async def install_cli(self, sb: Sandbox) -> None:
        if os.environ.get(self.cli_tarball_env):
            await install_npm_cli(sb, node_runtime=Path(os.environ[self.node_tarball_env]),
                                  npm_package=Path(os.environ[self.cli_tarball_env]),
                                  check_cmd="ls -la /usr/local/bin/claude && /usr/local/bin/claude --version")
            return
        code, out, err = await sb.exec(f"{shlex.quote(self.cli)} --version", user="root", timeout=60)
        if code != 0:
            raise RuntimeError(f"Claude Code is not runnable in the sandbox at {self.cli} (exit {code}: "
                               f"{(out + err)[-300:]}); run scripts/setup_agent_clis.sh and set {self.bin_env}, or "
                               f"set {self.node_tarball_env} and {self.cli_tarball_env}")

    async def write_config(self, sb: Sandbox, ctx: HarnessContext) -> None:
        """Pre-accept onboarding and the bypass-permissions prompt, so the CLI starts headless."""
        settings = json.dumps({"hasCompletedOnboarding": True, "bypassPermissionsModeAccepted": True})
        await sb.exec(f"mkdir -p /home/agent/.claude && echo {shlex.quote(settings)} | tee /home/agent/.claude.json "
                      "/home/agent/.claude/settings.json > /dev/null && "
                      "chown -R agent:agent /home/agent/.claude /home/agent/.claude.json",
                      user="root", check=True, timeout=60)

    def command(self, prompt: str) -> str:
        cmd = f"{self.cli} -p {shlex.quote(prompt)} {self.launch_flags}"
        extra = os.environ.get(self.extra_args_env, "").strip()
        return f"{cmd} {extra}" if extra else cmd

    def environment(self, ctx: HarnessContext) -> dict[str, str]:
        env = {"ANTHROPIC_BASE_URL": ctx.adapter_url, "ANTHROPIC_AUTH_TOKEN": ctx.session_id,
               "ANTHROPIC_MODEL": ctx.model_label, **self.static_env}
        extra = os.environ.get(self.extra_envs_env, "").strip()
        if extra:
            env.update(_json_object(extra, self.extra_envs_env))
        return env

    async def launch_and_wait(self, sb: Sandbox, ctx: HarnessContext, prompt: str, time_budget_sec: int) -> int:
        return await run_agent(sb, workdir=ctx.workdir, start_cmd=self.command(prompt), env=self.environment(ctx),
                               time_budget_sec=time_budget_sec)


def _json_object(text: str, name: str) -> dict[str, str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{name} must be a JSON object of environment variables: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object of environment variables, got {type(value).__name__}")
    return {str(k): str(v) for k, v in value.items()}
