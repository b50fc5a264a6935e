"""`LocalSandbox`: slime's `Sandbox` protocol on this machine, without a hosted service. Each sandbox is a set of
Linux namespaces (user, mount, PID, network, IPC, UTS) around a private RAM-backed file tree, with the host's /usr
read-only, its own users (root inside is an unprivileged host id), kernel-enforced limits (SandboxLimits) and no
network but one loopback port forwarded to the host (the adapter's).

Every `exec` enters the namespaces with util-linux's `nsenter`, switches user with `setpriv` and runs `bash -c`;
files travel through `exec` as well (`cat`), so they are read and written with the user's rights and the sandbox's
own view of its paths (a symlink inside cannot point the host at a host file).

Needs root on the host (to map the sandbox's ids and make its cgroup); `local_sandbox_problems()` says what is
missing. What it is not: a container image runtime (the userland is the host's) or a security boundary against
kernel exploits.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

from slime.agent.local_sandbox.cgroups import SandboxCgroup, sweep_stale_groups
from slime.agent.local_sandbox.commands import command_argv, run_captured
from slime.agent.local_sandbox.host import (
    ID_RANGE,
    SandboxUnavailable,
    acquire_id_slot,
    local_sandbox_problems,
    sweep_stale_roots,
)
from slime.agent.local_sandbox.limits import SandboxLimits, SandboxReport
from slime.agent.local_sandbox.loopback import LoopbackForward
from slime.agent.sandbox import EXIT_TIME_BUDGET_EXCEEDED, ExecResult, FileContent

INIT_PROCESS = Path(__file__).with_name("init_process.py")
START_TIMEOUT_SEC = 60
EXIT_EXEC_TIMEOUT = 124
MAX_OUTPUT_BYTES = 16 << 20  # per stream and command: more is dropped (and said), the trainer's memory is not the agent's
def _netstat(pid: int) -> dict[str, int]:
    """The IP and TCP counters of the network namespace of `pid` ("Ip.OutNoRoutes", "Tcp.AttemptFails", ...), and
    the IPv6 ones ("Ip6OutNoRoutes")."""
    counters = {}
    lines = Path(f"/proc/{pid}/net/snmp").read_text().splitlines()
    for header, values in zip(lines[::2], lines[1::2]):
        prefix, names = header.split(":", 1)
        for name, value in zip(names.split(), values.split(":", 1)[1].split()):
            counters[f"{prefix}.{name}"] = int(value)
    snmp6 = Path(f"/proc/{pid}/net/snmp6")
    if snmp6.exists():  # no IPv6 in the kernel: nothing to count
        counters.update((name, int(value)) for name, value in (line.split() for line in snmp6.read_text().splitlines()))
    return counters


def _blocked(counters: dict[str, int]) -> int:
    """Packets sent toward an address with no route: anything outside the sandbox, IPv4 or IPv6."""
    return counters.get("Ip.OutNoRoutes", 0) + counters.get("Ip6OutNoRoutes", 0)


class LocalSandbox:
    """A sandbox on this machine (see the module docstring). Use as `async with LocalSandbox() as sb:`.

    image: the userland; only the host's ("host", "local", "" or None) is available here.
    allowed_port: the host's 127.0.0.1 port that the sandbox may reach, at the same 127.0.0.1 port inside.
    read_only_mounts: host path -> sandbox path, bound read-only (e.g. a CLI installed once on the host).
    """

    HOST_IMAGES = (None, "", "host", "local")

    def __init__(
        self,
        image: str | None = None,
        *,
        limits: SandboxLimits | None = None,
        allowed_port: int | None = None,
        read_only_mounts: dict[str, str] | None = None,
    ) -> None:
        if image not in self.HOST_IMAGES:
            raise ValueError(
                f"LocalSandbox image={image!r}: the local sandbox runs the host's userland (/usr read-only), it "
                "cannot pull an image. Pass image='host', or install what the task needs on the host"
            )
        if allowed_port is not None and not 0 < allowed_port < 65536:
            raise ValueError(f"LocalSandbox allowed_port={allowed_port} is not a TCP port")
        for host_path, sandbox_path in (read_only_mounts or {}).items():
            if not Path(host_path).exists() or not sandbox_path.startswith("/"):
                raise ValueError(f"LocalSandbox read_only_mounts: {host_path!r} -> {sandbox_path!r} needs an "
                                 "existing host path and an absolute sandbox path")
        self.image = image
        self.limits = limits or SandboxLimits()
        self.allowed_port = allowed_port
        self.read_only_mounts = dict(read_only_mounts or {})
        self.sandbox_id = ""
        self.init_pid = 0
        self._init_proc: asyncio.subprocess.Process | None = None
        self._cgroup: SandboxCgroup | None = None
        self._forward: LoopbackForward | None = None
        self._watchdog: asyncio.Task | None = None
        self._slot_fd: int | None = None
        self._root_dir: str | None = None
        self._started = 0.0
        self._expired = False
        self._cpu_limit_kills = 0
        self._disk_full = False

    # ----------------------------------------------------------------------------------------------- lifecycle

    async def __aenter__(self) -> LocalSandbox:
        problems = local_sandbox_problems()
        if problems:
            raise SandboxUnavailable("cannot start a local sandbox: " + "; ".join(problems))
        self.sandbox_id = f"local-{uuid.uuid4().hex[:12]}"  # its cgroup: slime-local-... (cgroups.GROUP_PREFIX)
        try:
            await self._start()
        except BaseException:
            await self._teardown()
            raise
        return self

    async def _start(self) -> None:
        self._slot_fd, id_base = acquire_id_slot()
        await asyncio.to_thread(sweep_stale_groups)
        await asyncio.to_thread(sweep_stale_roots)
        self._cgroup = SandboxCgroup.create(f"slime-{self.sandbox_id}", memory_bytes=self.limits.memory_bytes,
                                            max_processes=self.limits.max_processes)
        self._root_dir = tempfile.mkdtemp(prefix=f"slime-{self.sandbox_id}-")
        config = {"root_dir": self._root_dir, "disk_bytes": self.limits.disk_bytes,
                  "read_only_mounts": self.read_only_mounts}
        self._init_proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", str(INIT_PROCESS), json.dumps(config),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            start_new_session=True)
        proc = self._init_proc
        # joined before it forks anything: everything of the sandbox descends from it
        self._cgroup.join(proc.pid)
        await self._expect_line("unshared")
        for name in ("uid_map", "gid_map"):
            Path(f"/proc/{proc.pid}/{name}").write_text(f"0 {id_base} {ID_RANGE}\n")
        proc.stdin.write(b"go\n")
        await proc.stdin.drain()
        seen: dict[str, str] = {}
        while not ("pid" in seen and "ready" in seen):
            word, _, rest = (await self._expect_line()).partition(" ")
            seen[word] = rest
        self.init_pid = int(seen["pid"])
        self._started = time.monotonic()
        if self.allowed_port is not None:
            self._forward = LoopbackForward(f"/proc/{self.init_pid}/ns/net", self.allowed_port)
            await self._forward.start()
        self._watchdog = asyncio.get_running_loop().create_task(self._episode_clock())

    async def _expect_line(self, expected: str | None = None) -> str:
        proc = self._init_proc
        try:
            line = (await asyncio.wait_for(proc.stdout.readline(), START_TIMEOUT_SEC)).decode().strip()
        except TimeoutError:
            line = ""
        if line.startswith("error ") or not line or (expected and line != expected):
            stderr = b""
            if proc.returncode is not None or line:
                proc.kill()
                stderr = await proc.stderr.read()
            raise SandboxUnavailable(f"local sandbox {self.sandbox_id} failed to start: {line or 'no answer'}"
                                     f"{' / ' + stderr.decode()[-2000:] if stderr else ''}")
        return line

    async def __aexit__(self, exc_type, exc, tb) -> None:
        await self._teardown()

    async def _teardown(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            await asyncio.gather(self._watchdog, return_exceptions=True)
            self._watchdog = None
        if self._forward is not None:
            await self._forward.stop()
            self._forward = None
        if self._init_proc is not None:
            if self.init_pid:
                try:
                    os.kill(self.init_pid, signal.SIGKILL)  # PID 1: the kernel ends the whole PID namespace
                except ProcessLookupError:
                    pass
            try:  # its parent reaps it and exits
                await asyncio.wait_for(self._init_proc.wait(), 10)
            except TimeoutError:
                self._init_proc.kill()
                await self._init_proc.wait()
            self._init_proc = None
        if self._cgroup is not None:
            await asyncio.to_thread(self._cgroup.remove)
            self._cgroup = None
        if self._root_dir is not None:
            shutil.rmtree(self._root_dir, ignore_errors=True)
            self._root_dir = None
        if self._slot_fd is not None:
            os.close(self._slot_fd)
            self._slot_fd = None

    async def _episode_clock(self) -> None:
        await asyncio.sleep(self.limits.episode_time_budget_sec)
        self._expired = True
        await self.kill_all_processes()

    async def kill_all_processes(self) -> None:
        """SIGKILL every process of the sandbox but its PID 1 (a runaway agent, a fork bomb); files stay."""
        if self._init_proc is None:
            raise RuntimeError("LocalSandbox.kill_all_processes() needs a running sandbox")
        await asyncio.to_thread(self._cgroup.kill_all, keep={self.init_pid, self._init_proc.pid})

    # ----------------------------------------------------------------------------------------------- commands

    async def exec(
        self,
        cmd: str,
        *,
        user: str = "root",
        env: dict[str, str] | None = None,
        timeout: int = 120,
        check: bool = False,
        idempotent: bool = True,
    ) -> ExecResult:
        """Run `cmd` with bash as `user` (a name in the sandbox's /etc/passwd), starting in the user's home.

        Exit codes: the command's; 128+N when a signal N ended it; 124 when `timeout` passed (the command's
        processes are killed); EXIT_TIME_BUDGET_EXCEEDED once the sandbox's episode budget is spent. A limit that
        stopped the command is named on stderr ("[sandbox] ..."). `idempotent` is accepted and unused: nothing
        here is retried."""
        return await self._run(cmd, user=user, env=env, timeout=timeout, check=check, stdin=None)

    async def _run(self, cmd, *, user, env, timeout, check, stdin) -> ExecResult:
        if self._init_proc is None:
            raise RuntimeError("LocalSandbox.exec outside `async with`: the sandbox is not running")
        if self._init_proc.returncode is not None or not Path(f"/proc/{self.init_pid}/net").exists():
            raise RuntimeError(f"local sandbox {self.sandbox_id} is gone: its init process exited; open a new "
                               "sandbox")
        if self._expired:
            message = (f"[sandbox] the episode's wall-clock budget of {self.limits.episode_time_budget_sec:g}s "
                       "is spent; the sandbox's processes were killed")
            if check:
                raise RuntimeError(f"sandbox exec refused: {message}")
            return EXIT_TIME_BUDGET_EXCEEDED, "", message
        limits = self.limits
        argv = command_argv(
            cgroup_procs=(str(self._cgroup.memory_dir / "cgroup.procs"), str(self._cgroup.pids_dir / "cgroup.procs")),
            cpu_time_sec=limits.cpu_time_sec, max_file_bytes=limits.max_file_bytes,
            max_open_files=limits.max_open_files, init_pid=self.init_pid, user=user, env=env, cmd=cmd)
        before = self._counters()
        notes = []
        try:
            proc, out, err, dropped = await run_captured(argv, stdin=stdin, timeout=timeout,
                                                         max_output_bytes=MAX_OUTPUT_BYTES)
            code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
            if dropped:
                notes.append(f"[sandbox] output past {MAX_OUTPUT_BYTES} bytes per stream dropped ({dropped} bytes)")
        except TimeoutError as error:
            try:
                os.killpg(error.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await error.process.wait()
            await asyncio.to_thread(self._wait_group_gone, error.process.pid)
            out, err, code = b"", b"", EXIT_EXEC_TIMEOUT
            notes.append(f"[sandbox] command timed out after {timeout}s and was killed")
        notes += self._limit_notes(before, code)
        stdout = out.decode(errors="replace")
        stderr = err.decode(errors="replace") + "".join(f"\n{n}" for n in notes)
        if check and code != 0:
            raise RuntimeError(f"sandbox exec failed (exit={code}): {cmd[:120]}\n{stderr[-400:]}")
        return code, stdout, stderr

    def _wait_group_gone(self, pgid: int, timeout: float = 5.0) -> None:
        """Until no live process of the sandbox is in process group `pgid` (zombies waiting for PID 1 are dead)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            alive = False
            for pid in self._cgroup.pids():
                try:
                    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                except FileNotFoundError:
                    continue
                if int(fields[2]) == pgid and fields[0] != "Z":
                    alive = True
                    os.kill(pid, signal.SIGKILL)
            if not alive:
                return
            time.sleep(0.02)

    def _counters(self) -> dict[str, int]:
        net = _netstat(self.init_pid)
        return {"oom_kills": self._cgroup.oom_kills(), "process_limit_hits": self._cgroup.process_limit_hits(),
                "network": _blocked(net)}

    def _limit_notes(self, before: dict[str, int], code: int) -> list[str]:
        after = self._counters()
        limits, notes = self.limits, []
        if after["oom_kills"] > before["oom_kills"]:
            notes.append(f"[sandbox] memory limit of {limits.memory_bytes} bytes reached: "
                         f"{after['oom_kills'] - before['oom_kills']} process(es) killed")
        if after["process_limit_hits"] > before["process_limit_hits"]:
            notes.append(f"[sandbox] process limit of {limits.max_processes} reached: "
                         f"{after['process_limit_hits'] - before['process_limit_hits']} fork(s) refused")
        if code == 128 + signal.SIGXCPU:
            self._cpu_limit_kills += 1
            notes.append(f"[sandbox] CPU-time limit of {limits.cpu_time_sec}s per process reached (SIGXCPU)")
        if after["network"] > before["network"]:
            allowed = f"only 127.0.0.1:{self.allowed_port} is forwarded" if self.allowed_port else "no port is open"
            notes.append(f"[sandbox] network blocked: {after['network'] - before['network']} attempt(s) to reach "
                         f"an address outside the sandbox ({allowed})")
        used, free = self._disk_usage()
        if free < 64 * 1024:
            self._disk_full = True
            notes.append(f"[sandbox] disk limit of {limits.disk_bytes} bytes reached ({used} bytes used)")
        return notes

    def _disk_usage(self) -> tuple[int, int]:
        fs = os.statvfs(f"/proc/{self.init_pid}/root/")
        return (fs.f_blocks - fs.f_bfree) * fs.f_frsize, fs.f_bavail * fs.f_frsize

    # ----------------------------------------------------------------------------------------------- files

    async def write_file(self, sandbox_path: str, content: FileContent, *, user: str = "root") -> None:
        """Write `content` (text, bytes, or the bytes of a host `Path`) to `sandbox_path` as `user`, making the
        parent folder if needed. Raises RuntimeError if the user may not write there (or the disk is full)."""
        quoted = shlex.quote(sandbox_path)
        cmd = f'mkdir -p "$(dirname {quoted})" && cat > {quoted}'
        if isinstance(content, Path):
            with open(content, "rb") as host_file:
                await self._run(cmd, user=user, env=None, timeout=600, check=True, stdin=host_file)
            return
        data = content.encode() if isinstance(content, str) else bytes(content)
        await self._run(cmd, user=user, env=None, timeout=600, check=True, stdin=data)

    async def read_file(self, sandbox_path: str, *, user: str = "root") -> str:
        """The file's text as `user` may read it ("" when it cannot be read, as slime's backends do)."""
        code, out, _ = await self._run(f"cat {shlex.quote(sandbox_path)}", user=user, env=None, timeout=600,
                                       check=False, stdin=None)
        return out if code == 0 else ""

    # ----------------------------------------------------------------------------------------------- report

    def report(self) -> SandboxReport:
        """What the sandbox used so far and which limits stopped something (while it runs)."""
        if self._init_proc is None:
            raise RuntimeError("LocalSandbox.report() needs a running sandbox: call it inside `async with`")
        net = _netstat(self.init_pid)
        used, _ = self._disk_usage()
        return SandboxReport(
            memory_peak_bytes=self._cgroup.memory_peak_bytes(), oom_kills=self._cgroup.oom_kills(),
            process_limit_hits=self._cgroup.process_limit_hits(), cpu_limit_kills=self._cpu_limit_kills,
            disk_used_bytes=used, disk_full=self._disk_full,
            network_blocked_attempts=_blocked(net),
            refused_loopback_connections=net.get("Tcp.AttemptFails", 0),
            episode_time_exceeded=self._expired, episode_seconds=time.monotonic() - self._started)
