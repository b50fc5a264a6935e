"""What every CLI harness shares (slime's `slime.agent.harness.common`): the run skeleton, the detached launch of
the agent as the sandbox's non-root `agent` user, and the install of an npm-packaged CLI.

`BaseHarness.run` = `ensure_agent_user` -> `write_config` -> `launch_and_wait` -> the CLI's exit code (or
`EXIT_TIME_BUDGET_EXCEEDED` when the episode outran its budget). A subclass implements `install_cli`, `write_config`
and `launch_and_wait` (usually one command handed to `run_agent`). One instance per harness class (a singleton).

Not the task: preparing the workspace and scoring it is the caller's (examples/coding_agent_rl/swe.py).
"""

from __future__ import annotations

import asyncio
import lzma
import os
import shutil
import tempfile
from abc import ABC, ABCMeta, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from slime.agent import sandbox as _sandbox
from slime.agent.sandbox import Sandbox, exec_and_wait
from slime.utils.misc import SingletonMeta

NPM_INSTALL_RETRIES = 3
NPM_INSTALL_BACKOFF_SEC = 2.0


class SingletonABCMeta(ABCMeta, SingletonMeta):
    pass


@dataclass(frozen=True)
class HarnessContext:
    """One episode's wiring: the workspace, the adapter session the CLI authenticates with, the adapter's URL (no
    /v1), and the model name the CLI is told (the adapter serves whatever the engines hold, whatever the name)."""

    workdir: str
    session_id: str
    adapter_url: str
    model_label: str = "slime-actor"


class BaseHarness(ABC, metaclass=SingletonABCMeta):
    """A coding-agent CLI's life in a sandbox (module docstring)."""

    name: str = ""

    @abstractmethod
    async def install_cli(self, sb: Sandbox) -> None:
        """Make the CLI runnable in the sandbox."""

    @abstractmethod
    async def write_config(self, sb: Sandbox, ctx: HarnessContext) -> None:
        """Write the CLI's config files for the `agent` user."""

    @abstractmethod
    async def launch_and_wait(self, sb: Sandbox, ctx: HarnessContext, prompt: str, time_budget_sec: int) -> int:
        """Run one episode to its end; the CLI's exit code, or EXIT_TIME_BUDGET_EXCEEDED."""

    async def run(self, sb: Sandbox, *, workdir: str, session_id: str, adapter_url: str, time_budget_sec: int,
                  prompt: str) -> int:
        await _sandbox.ensure_agent_user(sb, workdir)
        ctx = HarnessContext(workdir=workdir, session_id=session_id, adapter_url=adapter_url)
        await self.write_config(sb, ctx)
        return await self.launch_and_wait(sb, ctx, prompt, time_budget_sec)


async def run_agent(sb: Sandbox, *, workdir: str, start_cmd: str, env: dict[str, str], time_budget_sec: int) -> int:
    """Run `start_cmd` as the `agent` user in `workdir`, detached, until it exits or `time_budget_sec` passes; its
    output goes to `{workdir}/.harness/trajectory.jsonl`. The exit code (EXIT_TIME_BUDGET_EXCEEDED on time out)."""
    meta_dir = f"{workdir}/.harness"
    await sb.exec(f"mkdir -p {meta_dir} && chown agent:agent {meta_dir}", user="root", check=True, timeout=30)
    exit_code, _ = await exec_and_wait(sb, cmd=start_cmd, user="agent", env=env, workdir=workdir,
                                       out_file=f"{meta_dir}/trajectory.jsonl", time_budget_sec=time_budget_sec,
                                       tag="run", want_output=False)
    return exit_code


async def install_npm_cli(sb: Sandbox, *, node_runtime: Path, npm_package: Path, check_cmd: str) -> None:
    """Install an npm-packaged CLI into the sandbox from host files, offline: the Node runtime tarball, then the
    CLI's package tarball (`npm install -g`; the tarball must carry the platform package with the native binary, as
    one made by `npm pack` of an installed tree does), then `check_cmd`. Retried NPM_INSTALL_RETRIES times;
    RuntimeError with the install log's tail when every try fails."""
    await install_node22(sb, node_runtime)
    await sb.write_file("/tmp/harness-cli.tgz", npm_package)
    install_cmd = f"npm install -g --prefix=/usr/local --no-audit --no-fund /tmp/harness-cli.tgz && {check_cmd}"
    exit_code, log = -1, ""
    for attempt in range(NPM_INSTALL_RETRIES):
        exit_code, log = await exec_and_wait(sb, cmd=install_cmd, user="root", time_budget_sec=300,
                                             tag="harness-npm-install")
        if exit_code == 0:
            return
        if attempt + 1 < NPM_INSTALL_RETRIES:
            await asyncio.sleep(NPM_INSTALL_BACKOFF_SEC * (attempt + 1))
    raise RuntimeError(f"npm install failed after {NPM_INSTALL_RETRIES} attempts (exit={exit_code}):\n{log[-1000:]}")


async def install_node22(sb: Sandbox, host_tarball: Path) -> None:
    """Unpack a Node runtime tarball (a .tar.xz is decompressed once on the host, so the sandbox needs no xz) into
    /opt/node22 and link node / npm / npx into /usr/local/bin."""
    host_tarball = Path(host_tarball)
    if host_tarball.suffix == ".xz":
        plain = Path(tempfile.gettempdir()) / f"coding_agent_rl.{host_tarball.stem}.tar"
        if not plain.exists():
            partial = plain.with_suffix(".tar.partial")
            with lzma.open(host_tarball, "rb") as source, open(partial, "wb") as target:
                shutil.copyfileobj(source, target)
            os.replace(partial, plain)
        host_tarball = plain
    await sb.write_file("/tmp/node22.tar", host_tarball)
    await sb.exec("set -e && mkdir -p /opt/node22 && tar xf /tmp/node22.tar -C /opt/node22 --strip-components=1 && "
                  "for tool in node npm npx; do ln -sf /opt/node22/bin/$tool /usr/local/bin/$tool; done && "
                  "node --version && npm --version", user="root", timeout=180, check=True)
