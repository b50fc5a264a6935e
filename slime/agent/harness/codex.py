"""Codex (`codex exec`) as a harness (slime's `CodexHarness`).

The CLI reads `~/.codex/config.toml`: a provider `slime` whose `base_url` is the adapter's /v1 (inline: Codex takes
base-URL variables only for its built-in OpenAI provider), the key from `OPENAI_API_KEY` = the session id, and
`wire_api`: "chat" (slime's default, for Codex releases up to early 2026) or "responses" (what current Codex accepts
only; `SLIME_AGENT_CODEX_WIRE_API=responses`, as scripts/setup_agent_clis.sh's pinned Codex needs). The config
also switches off what Codex would do on the network besides the adapter (plugins sync, analytics, the update check,
web search) and its own inner sandbox (the episode already runs in ours): `sandbox_mode = "danger-full-access"`,
`approval_policy = "never"`. The config is written through a base64 round trip (no shell quoting traps).

Host environment: `SLIME_AGENT_CODEX_BIN` (default `codex` on PATH), `SLIME_AGENT_CODEX_WIRE_API`,
`SLIME_AGENT_NODE_TARBALL` + `SLIME_AGENT_CODEX_TARBALL` (install from host tarballs; unset: the CLI must be
runnable already), `SLIME_AGENT_CODEX_EXTRA_ARGS`, `SLIME_AGENT_CODEX_EXTRA_ENVS` (JSON object, merged last).
"""

from __future__ import annotations

import base64
import os
import shlex
from pathlib import Path

from slime.agent.harness.claude_code import _json_object
from slime.agent.harness.common import BaseHarness, HarnessContext, install_npm_cli, run_agent
from slime.agent.sandbox import Sandbox

WIRE_APIS = ("chat", "responses")


class CodexHarness(BaseHarness):
    name = "codex"

    bin_env = "SLIME_AGENT_CODEX_BIN"
    default_bin = "codex"
    wire_api_env = "SLIME_AGENT_CODEX_WIRE_API"
    default_wire_api = "chat"
    node_tarball_env = "SLIME_AGENT_NODE_TARBALL"
    cli_tarball_env = "SLIME_AGENT_CODEX_TARBALL"
    extra_args_env = "SLIME_AGENT_CODEX_EXTRA_ARGS"
    extra_envs_env = "SLIME_AGENT_CODEX_EXTRA_ENVS"

    exec_flags = "--skip-git-repo-check"
    config_toml = (
        'model = "{model}"\n'
        'model_provider = "slime"\n'
        'sandbox_mode = "danger-full-access"\n'
        'approval_policy = "never"\n'
        "check_for_update_on_startup = false\n"
        'web_search = "disabled"\n'
        "\n"
        "[model_providers.slime]\n"
        'name = "slime"\n'
        'base_url = "{base_url}"\n'
        'env_key = "OPENAI_API_KEY"\n'
        'wire_api = "{wire_api}"\n'
        "request_max_retries = 1\n"
        "stream_max_retries = 1\n"
        "\n"
        "[features]\n"
        "plugins = false\n"
        "\n"
        "[analytics]\n"
        "enabled = false\n"
    )

    @property
    def cli(self) -> str:
        return os.environ.get(self.bin_env) or self.default_bin

    @property
    def wire_api(self) -> str:
        wire_api = os.environ.get(self.wire_api_env) or self.default_wire_api
        if wire_api not in WIRE_APIS:
            raise ValueError(f"{self.wire_api_env}={wire_api!r}: use one of {WIRE_APIS} (current Codex: responses)")
        return wire_api

    async def install_cli(self, sb: Sandbox) -> None:
        if os.environ.get(self.cli_tarball_env):
            await install_npm_cli(sb, node_runtime=Path(os.environ[self.node_tarball_env]),
                                  npm_package=Path(os.environ[self.cli_tarball_env]), check_cmd="codex --version")
            return
        code, out, err = await sb.exec(f"{shlex.quote(self.cli)} --version", user="root", timeout=60)
        if code != 0:
            raise RuntimeError(f"Codex is not runnable in the sandbox at {self.cli} (exit {code}: {(out + err)[-300:]});"
                               f" run scripts/setup_agent_clis.sh and set {self.bin_env}, or set "
                               f"{self.node_tarball_env} and {self.cli_tarball_env}")

    def config(self, ctx: HarnessContext) -> str:
        return self.config_toml.format(model=ctx.model_label, base_url=f"{ctx.adapter_url}/v1", wire_api=self.wire_api)

    async def write_config(self, sb: Sandbox, ctx: HarnessContext) -> None:
        encoded = base64.b64encode(self.config(ctx).encode()).decode("ascii")
        await sb.exec(f"mkdir -p /home/agent/.codex && echo {shlex.quote(encoded)} | base64 -d > "
                      "/home/agent/.codex/config.toml && chown -R agent:agent /home/agent/.codex",
                      user="root", check=True, timeout=60)

    def command(self, prompt: str) -> str:
        cmd = f"{self.cli} exec {self.exec_flags} {shlex.quote(prompt)}"
        extra = os.environ.get(self.extra_args_env, "").strip()
        return f"{cmd} {extra}" if extra else cmd

    def environment(self, ctx: HarnessContext) -> dict[str, str]:
        env = {"OPENAI_API_KEY": ctx.session_id, "OPENAI_BASE_URL": f"{ctx.adapter_url}/v1"}
        extra = os.environ.get(self.extra_envs_env, "").strip()
        if extra:
            env.update(_json_object(extra, self.extra_envs_env))
        return env

    async def launch_and_wait(self, sb: Sandbox, ctx: HarnessContext, prompt: str, time_budget_sec: int) -> int:
        return await run_agent(sb, workdir=ctx.workdir, start_cmd=self.command(prompt), env=self.environment(ctx),
                               time_budget_sec=time_budget_sec)
