"""slime's way of putting a CLI into a sandbox works offline in a local one: a package tarball uploaded from the host,
`npm install -g --prefix=/usr/local` run detached through exec_and_wait as root, then the CLI on the agent's PATH."""

import asyncio
import io
import json
import shutil
import tarfile

import pytest

from slime.agent import sandbox as sandbox_mod
from slime.agent.local_sandbox import LocalSandbox, SandboxLimits
from slime.agent.sandbox import ensure_agent_user, exec_and_wait

CLI = '#!/usr/bin/env node\nconsole.log("hello from " + (process.argv[2] || "nowhere") + " as " + process.env.USER);\n'


def package_tarball(path) -> None:
    """An npm package as `npm pack` makes it: a gzip tar of package/package.json and its files."""
    files = {"package/package.json": json.dumps({"name": "hello-cli", "version": "1.0.0",
                                                 "bin": {"hello-cli": "cli.js"}}),
             "package/cli.js": CLI}
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            info = tarfile.TarInfo(name)
            data = text.encode()
            info.size, info.mode = len(data), 0o755
            tar.addfile(info, io.BytesIO(data))


@pytest.mark.skipif(shutil.which("npm") is None, reason="npm is not installed on this host")
def test_npm_cli_install_and_run_as_the_agent(tmp_path, monkeypatch):
    monkeypatch.setattr(sandbox_mod, "MARKER_POLL_INTERVAL_SEC", 0.5)
    package_tarball(tmp_path / "hello-cli.tgz")

    async def case():
        limits = SandboxLimits(memory_bytes=1 << 30, disk_bytes=256 << 20, episode_time_budget_sec=600)
        async with LocalSandbox(limits=limits) as sb:
            await sb.write_file("/tmp/harness-cli.tgz", tmp_path / "hello-cli.tgz")
            code, out = await exec_and_wait(
                sb, cmd="npm install -g --prefix=/usr/local --no-audit --no-fund /tmp/harness-cli.tgz && "
                        "hello-cli install", time_budget_sec=300, tag="harness-npm-install", want_output=True)
            assert code == 0, out
            assert out.rstrip().endswith("hello from install as root")
            await sb.exec("mkdir -p /workspace/repo", check=True)
            await ensure_agent_user(sb, "/workspace/repo")
            code, out, err = await sb.exec("hello-cli episode", user="agent")
            assert (code, out) == (0, "hello from episode as agent\n"), err
            assert sb.report().network_blocked_attempts == 0  # npm needed nothing from outside

    asyncio.run(case())
