"""What keeps a sandbox from bending its own limits or harming the trainer: no mounts even as root (the disk limit
holds), output capped, PID 1 out of the OOM killer's reach, a dead sandbox refused loudly, and many sandboxes at
once, each in its own id range."""

import asyncio
import os
import signal
from pathlib import Path

import pytest

from slime.agent.local_sandbox import LocalSandbox, SandboxLimits
from slime.agent.local_sandbox.commands import COMMAND_OOM_SCORE_ADJ
from slime.agent.local_sandbox.local import MAX_OUTPUT_BYTES

LIMITS = SandboxLimits(memory_bytes=256 << 20, disk_bytes=32 << 20, max_processes=64, episode_time_budget_sec=300)


def run(coro):
    return asyncio.run(coro)


def test_root_inside_cannot_mount_past_the_disk_limit():
    async def case():
        async with LocalSandbox(limits=LIMITS) as sb:
            code, _, err = await sb.exec("mkdir -p /mnt/x && mount -t tmpfs -o size=1g none /mnt/x")
            assert code != 0 and "permission denied" in err.lower()
            code, _, err = await sb.exec("umount /proc")
            assert code != 0
            code, out, _ = await sb.exec("grep CapEff /proc/self/status")
            effective = int(out.split()[1], 16)
            assert effective != 0 and not effective & (1 << 21) and not effective & (1 << 12)  # SYS_ADMIN, NET_ADMIN
            # root keeps what provisioning needs
            assert (await sb.exec("useradd -m dev && chown dev /tmp && id dev"))[0] == 0

    run(case())


def test_output_past_the_cap_is_dropped_and_said():
    async def case():
        async with LocalSandbox(limits=LIMITS) as sb:
            code, out, err = await sb.exec(f"head -c {MAX_OUTPUT_BYTES + 4096} /dev/zero; echo done >&2")
            assert code == 0 and len(out) == MAX_OUTPUT_BYTES
            assert err.startswith("done\n") and "[sandbox] output past 16777216 bytes per stream dropped (4096 bytes)" in err

    run(case())


def test_pid_1_is_out_of_the_oom_killers_reach_and_a_dead_sandbox_is_refused():
    async def case():
        async with LocalSandbox(limits=LIMITS) as sb:
            assert Path(f"/proc/{sb.init_pid}/oom_score_adj").read_text().strip() == "0"
            assert (await sb.exec("cat /proc/self/oom_score_adj"))[1].strip() == str(COMMAND_OOM_SCORE_ADJ)
            os.kill(sb.init_pid, signal.SIGKILL)
            await asyncio.wait_for(sb._init_proc.wait(), 10)
            with pytest.raises(RuntimeError, match="is gone"):
                await sb.exec("true")

    run(case())


def test_many_sandboxes_at_once():
    async def one(i: int) -> tuple[str, str, str]:
        async with LocalSandbox(limits=LIMITS) as sb:
            await sb.write_file("/tmp/me", f"sandbox {i}")
            await sb.exec("sleep 0.5")
            uid = Path(f"/proc/{sb.init_pid}/status").read_text().split("Uid:")[1].split()[0]
            return await sb.read_file("/tmp/me"), uid, sb.sandbox_id

    async def case():
        results = await asyncio.gather(*(one(i) for i in range(6)))
        assert [text for text, _, _ in results] == [f"sandbox {i}" for i in range(6)]
        assert len({uid for _, uid, _ in results}) == 6 and len({sid for _, _, sid in results}) == 6

    run(case())
