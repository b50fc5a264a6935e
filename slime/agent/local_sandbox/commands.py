"""One command into a running local sandbox: the command line that gets there, and running it with a bounded
capture of its output.

The way in, each step `exec`-ing the next (one process chain, so a signal or a kill of its group reaches the command):
on the host `sh` joins the sandbox's cgroup and makes itself the OOM killer's first choice over the sandbox's PID 1,
and `prlimit` sets the per-process limits; `nsenter` enters its
namespaces (root inside); `sh` looks the user up in the sandbox's own /etc/passwd and `setpriv` becomes it, with its
login environment, no new privileges, and no CAP_SYS_ADMIN / CAP_NET_ADMIN even for root (so nothing inside can
mount over the size-limited tree or reconfigure the network); `env` adds the caller's variables; `bash` starts in
the user's home and runs the command line.

What it is not: the sandbox's lifecycle or its limit reports (local.py).
"""

from __future__ import annotations

import asyncio
import re

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
HOST_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
DROPPED_CAPABILITIES = "-sys_admin,-net_admin"
COMMAND_OOM_SCORE_ADJ = 500  # the OOM killer takes a command before the sandbox's PID 1 (at 0); raising needs no caps
HOST_WRAPPER = (
    'for f in "$1" "$2"; do echo $$ > "$f" || exit 125; done; '
    f'echo {COMMAND_OOM_SCORE_ADJ} > /proc/self/oom_score_adj; '
    'cpu=$3 fsize=$4 nofile=$5 target=$6; shift 6; '
    'exec prlimit --cpu="$cpu:$((cpu + 1))" --fsize="$fsize" --nofile="$nofile" -- '
    'nsenter --target "$target" --user --mount --pid --net --ipc --uts -- "$@"'
)
INNER_SWITCH_USER = (
    'user=$1; shift; group=$(id -g -- "$user") || exit 126; '
    f'exec setpriv --reuid="$user" --regid="$group" --init-groups --reset-env --nnp '
    f'--bounding-set={DROPPED_CAPABILITIES} --inh-caps=-all -- "$@"'
)
INNER_PRELUDE = 'cd ~ 2>/dev/null || cd /; exec /bin/bash -c "$0"'


def command_argv(*, cgroup_procs: tuple[str, str], cpu_time_sec: int, max_file_bytes: int, max_open_files: int,
                 init_pid: int, user: str, env: dict[str, str] | None, cmd: str) -> list[str]:
    """The host command line that runs `cmd` with bash as `user` inside the sandbox whose PID 1 is `init_pid`."""
    for name in env or {}:
        if not ENV_NAME.match(name):
            raise ValueError(f"LocalSandbox.exec env: {name!r} is not a valid environment variable name")
    return ["/bin/sh", "-c", HOST_WRAPPER, "sandbox-exec", *cgroup_procs, str(cpu_time_sec), str(max_file_bytes),
            str(max_open_files), str(init_pid),
            "/bin/sh", "-c", INNER_SWITCH_USER, "sandbox-user", user,
            "/usr/bin/env", *[f"{k}={v}" for k, v in (env or {}).items()],
            "/bin/bash", "-c", INNER_PRELUDE, cmd]


async def _read_capped(stream: asyncio.StreamReader, limit: int) -> tuple[bytes, int]:
    """Everything `stream` sends until EOF, keeping the first `limit` bytes; (kept, number of bytes dropped)."""
    kept, dropped = bytearray(), 0
    while chunk := await stream.read(1 << 16):
        room = limit - len(kept)
        kept += chunk[:room]
        dropped += max(0, len(chunk) - room)
    return bytes(kept), dropped


async def run_captured(argv: list[str], *, stdin, timeout: float, max_output_bytes: int):
    """Run `argv` in a new session; returns (process, stdout, stderr, bytes dropped) or raises TimeoutError (the
    caller kills the session: the process is `exc.process`). stdin: None, bytes, or an open file."""
    pipe = asyncio.subprocess.PIPE
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=pipe if isinstance(stdin, bytes) else (stdin or asyncio.subprocess.DEVNULL),
        stdout=pipe, stderr=pipe, start_new_session=True, env={"PATH": HOST_PATH})

    async def feed() -> None:
        if isinstance(stdin, bytes):
            try:
                proc.stdin.write(stdin)
                await proc.stdin.drain()
            except (BrokenPipeError, ConnectionResetError):
                pass  # the command stopped reading; its exit status says why
            finally:
                proc.stdin.close()

    async def everything():
        _, (out, out_dropped), (err, err_dropped) = await asyncio.gather(
            feed(), _read_capped(proc.stdout, max_output_bytes), _read_capped(proc.stderr, max_output_bytes))
        await proc.wait()
        return out, err, out_dropped + err_dropped

    try:
        out, err, dropped = await asyncio.wait_for(everything(), timeout)
    except TimeoutError as error:
        error.process = proc
        raise
    return proc, out, err, dropped
