"""A trainer that dies without closing its sandboxes takes them along: their processes end with it, and the empty
control groups and root folders they leave are swept by the next sandbox's start."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from slime.agent.local_sandbox.cgroups import sweep_stale_groups
from slime.agent.local_sandbox.host import sweep_stale_roots

REPO = Path(__file__).resolve().parents[3]
HOLD_A_SANDBOX = """
import asyncio, sys
from slime.agent.local_sandbox import LocalSandbox, SandboxLimits

async def main():
    sb = LocalSandbox(limits=SandboxLimits(memory_bytes=256 << 20, disk_bytes=32 << 20))
    await sb.__aenter__()
    await sb.exec("setsid sleep 1000 < /dev/null > /dev/null 2>&1 &", check=True)
    print(sb.init_pid, sb._init_proc.pid, sb._cgroup.pids_dir, sb._cgroup.memory_dir, sb._root_dir, flush=True)
    await asyncio.sleep(1000)

asyncio.run(main())
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_sandbox_dies_with_its_host_process_and_its_group_is_swept():
    host = subprocess.Popen([sys.executable, "-c", HOLD_A_SANDBOX], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        init_pid, parent_pid, pids_dir, memory_dir, root_dir = host.stdout.readline().split()
        pids = [int(p) for p in (Path(pids_dir) / "cgroup.procs").read_text().split()]
        assert len(pids) >= 3 and all(alive(pid) for pid in pids)
    finally:
        host.send_signal(signal.SIGKILL)
        host.wait()
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in pids), [pid for pid in pids if alive(pid)]
    deadline = time.monotonic() + 10
    while (Path(pids_dir) / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.1)
    removed = sweep_stale_groups(min_age_sec=0)
    assert {Path(pids_dir), Path(memory_dir)} <= set(removed)
    assert not Path(pids_dir).exists() and not Path(memory_dir).exists()
    assert Path(root_dir) in sweep_stale_roots(min_age_sec=0) and not Path(root_dir).exists()
