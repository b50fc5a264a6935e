"""The sandbox contract of agent rollouts, at slime's path and with slime's names: the `Sandbox` protocol (async
context manager, `exec`, `write_file`, `read_file`, `sandbox_id`), `exec_and_wait` (a long command run detached and
polled for its exit code) and `ensure_agent_user`.

What it is not: a sandbox. The local backend (namespaces, a private filesystem, resource limits, a loopback-only
network) is `slime.agent.local_sandbox.LocalSandbox`; harnesses and examples program against this protocol only.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Protocol, runtime_checkable

ExecResult = tuple[int, str, str]
"""(exit code, stdout, stderr) of one `Sandbox.exec`."""
FileContent = str | bytes | Path
"""What `Sandbox.write_file` takes: text, bytes, or a host file (a `Path`) whose bytes are streamed in."""

EXIT_TIME_BUDGET_EXCEEDED = -1
"""The exit code `exec_and_wait` returns when the command had not finished when its time budget ran out."""

MARKER_POLL_INTERVAL_SEC = 5
MARKER_POLL_TIMEOUT_SEC = 15


@runtime_checkable
class Sandbox(Protocol):
    """An isolated machine an agent runs in, driven by commands and file transfers.

    `exec` runs a shell command line as `user` and returns its exit code and output; with `check=True` a non-zero
    exit raises RuntimeError. `idempotent` tells a backend that retries severed transport calls whether replaying
    this command is safe; a backend without such retries ignores it. `write_file` takes text, bytes or a host `Path`;
    `read_file` returns the file's text ("" when it cannot be read).
    """

    sandbox_id: str

    async def __aenter__(self) -> Sandbox: ...

    async def __aexit__(self, exc_type, exc, tb) -> None: ...

    async def exec(
        self,
        cmd: str,
        *,
        user: str = "root",
        env: dict[str, str] | None = None,
        timeout: int = 120,
        check: bool = False,
        idempotent: bool = True,
    ) -> ExecResult: ...

    async def write_file(self, sandbox_path: str, content: FileContent, *, user: str = "root") -> None: ...

    async def read_file(self, sandbox_path: str, *, user: str = "root") -> str: ...


async def _await_done_marker(sb: Sandbox, done_file: str, *, user: str, time_budget_sec: float) -> int:
    """Poll the detached command's exit-code file every few seconds until it holds a code, or return
    EXIT_TIME_BUDGET_EXCEEDED once `time_budget_sec` has passed. Each poll is a short, replayable command."""
    deadline = time.time() + time_budget_sec
    while time.time() < deadline:
        await asyncio.sleep(MARKER_POLL_INTERVAL_SEC)
        exit_code, out, _ = await sb.exec(
            f"test -f {done_file} && cat {done_file}", user=user, timeout=MARKER_POLL_TIMEOUT_SEC, check=False
        )
        if exit_code == 0 and (out or "").strip():
            return int(out.strip())
    return EXIT_TIME_BUDGET_EXCEEDED


async def exec_and_wait(
    sb: Sandbox,
    *,
    cmd: str,
    time_budget_sec: float,
    tag: str,
    user: str = "root",
    env: dict[str, str] | None = None,
    workdir: str | None = None,
    out_file: str | None = None,
    want_output: bool = False,
) -> tuple[int, str]:
    """Run `cmd` detached (setsid, output to a file, exit code to `/tmp/.{tag}.done`) and poll until it ends.

    Returns `(exit_code, output)`: output is "" on success unless `want_output` (then the whole output file), the
    last 512 bytes of output on failure, and the exit code is EXIT_TIME_BUDGET_EXCEEDED when the budget ran out
    first (the command is left running; the caller closes the sandbox). No single call holds a stream open for the
    command's lifetime, so a transport that severs long calls loses nothing. Two calls with the same `tag` must
    not overlap; a later call with the same tag runs the command again (its state is cleared first).
    """
    out_file = out_file or f"/tmp/.{tag}.out"
    done_file = f"/tmp/.{tag}.done"
    launcher = f"/tmp/.{tag}.sh"
    spawn_lock = f"/tmp/.{tag}.spawned"
    prelude = f"cd {workdir}\nexport HOME=/home/{user}\n" if workdir else ""
    await sb.write_file(launcher, f"#!/bin/bash\n{prelude}{cmd}\necho $? > {done_file}\n", user=user)
    # Clearing the previous invocation's state is its own call, before the spawn: the spawn's mkdir guard only
    # dedupes a replay of that one spawn call and must not make a later call with this tag skip its launch.
    await sb.exec(f"rm -rf {spawn_lock}; rm -f {out_file} {done_file}", user=user, timeout=30, check=True)
    await sb.exec(
        f"chmod +x {launcher}; mkdir {spawn_lock} 2>/dev/null || exit 0; "
        f"setsid bash {launcher} < /dev/null > {out_file} 2>&1 &",
        user=user,
        env=env,
        timeout=30,
        check=True,
    )
    exit_code = await _await_done_marker(sb, done_file, user=user, time_budget_sec=time_budget_sec)
    if want_output:
        return exit_code, await sb.read_file(out_file, user=user)
    if exit_code == 0:
        return exit_code, ""
    _, tail, _ = await sb.exec(f"tail -c 512 {out_file} 2>/dev/null", user=user, timeout=15, check=False)
    return exit_code, tail or ""


async def ensure_agent_user(sb: Sandbox, workdir: str) -> None:
    """Create the unprivileged user `agent` (if absent), give it its home and `workdir`, and let git work in any
    directory. Idempotent."""
    await sb.exec(
        f"id agent >/dev/null 2>&1 || useradd -m -s /bin/bash agent && "
        f"chown -R agent:agent /home/agent {workdir} && "
        f"git config --system --add safe.directory '*' && id agent",
        user="root",
        check=True,
        timeout=60,
    )
