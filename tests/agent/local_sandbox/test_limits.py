"""Each limit of a LocalSandbox stops what goes past it, says so on the command's stderr and in report(), and leaves
the sandbox usable: a memory blow-up, a fork bomb, a CPU loop, a disk fill, a network attempt, the episode clock."""

import asyncio
import time

from slime.agent.local_sandbox import LocalSandbox, SandboxLimits
from slime.agent.sandbox import EXIT_TIME_BUDGET_EXCEEDED

MiB = 1 << 20


def limits(**overrides) -> SandboxLimits:
    base = dict(memory_bytes=256 * MiB, disk_bytes=64 * MiB, max_processes=48, cpu_time_sec=60,
                episode_time_budget_sec=300)
    return SandboxLimits(**{**base, **overrides})


def run(coro):
    return asyncio.run(coro)


async def still_usable(sb: LocalSandbox) -> None:
    assert await sb.exec("echo alive") == (0, "alive\n", "")


def test_memory_blow_up_is_killed_and_reported():
    async def case():
        async with LocalSandbox(limits=limits()) as sb:
            # 600 MiB touched page by page, in a sandbox of 256 MiB
            code, _, err = await sb.exec("python3 -c 'b = bytearray(600 << 20); print(len(b))'", timeout=60)
            assert code == 137, err  # SIGKILL from the OOM killer
            assert "[sandbox] memory limit of 268435456 bytes reached" in err
            report = sb.report()
            assert report.oom_kills >= 1 and "memory" in report.limits_hit
            assert 200 * MiB < report.memory_peak_bytes <= 256 * MiB
            # within the limit, the same command works
            assert (await sb.exec("python3 -c 'b = bytearray(64 << 20); print(len(b))'"))[1] == f"{64 * MiB}\n"
            await still_usable(sb)

    run(case())


FORK_UNTIL_REFUSED = """
import os, signal, time
children = []
try:
    while True:
        pid = os.fork()
        if pid == 0:
            os.closerange(0, 3)
            time.sleep(60)
            os._exit(0)
        children.append(pid)
except BlockingIOError:
    for pid in children:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    print(len(children))
"""


def test_process_limit_refuses_forks_and_is_reported():
    async def case():
        async with LocalSandbox(limits=limits(max_processes=40)) as sb:
            await sb.write_file("/tmp/forker.py", FORK_UNTIL_REFUSED)
            code, out, err = await sb.exec("python3 /tmp/forker.py", timeout=60)
            # 40 in all: PID 1, its parent on the host, this command's nsenter on the host, the forker, its children
            assert int(out) == 40 - 4, (out, err)
            assert "[sandbox] process limit of 40 reached" in err
            assert sb.report().process_limit_hits > 0
            await sb.kill_all_processes()
            await still_usable(sb)

    run(case())


def test_fork_bomb_is_contained_and_cleared():
    async def case():
        async with LocalSandbox(limits=limits(max_processes=40)) as sb:
            await sb.exec("setsid bash -c 'bomb() { bomb | bomb & }; bomb' < /dev/null > /dev/null 2>&1 &")
            await asyncio.sleep(3)
            assert len(sb._cgroup.pids()) <= 40
            report = sb.report()
            assert report.process_limit_hits > 0 and "processes" in report.limits_hit
            await sb.kill_all_processes()
            assert sorted(sb._cgroup.pids()) == sorted({sb.init_pid, sb._init_proc.pid})
            await still_usable(sb)

    run(case())


def test_cpu_loop_is_stopped_at_its_cpu_time():
    async def case():
        async with LocalSandbox(limits=limits(cpu_time_sec=1)) as sb:
            start = time.monotonic()
            code, _, err = await sb.exec("python3 -c 'while True: pass'", timeout=120)
            assert code == 128 + 24, err  # SIGXCPU
            assert "[sandbox] CPU-time limit of 1s per process reached" in err
            assert time.monotonic() - start < 60
            assert "cpu_time" in sb.report().limits_hit
            await still_usable(sb)

    run(case())


def test_disk_fill_fails_with_enospc_and_is_reported():
    async def case():
        async with LocalSandbox(limits=limits(disk_bytes=32 * MiB)) as sb:
            code, _, err = await sb.exec("dd if=/dev/zero of=/tmp/fill bs=1M count=100")
            assert code == 1 and "No space left on device" in err
            assert "[sandbox] disk limit of 33554432 bytes reached" in err
            report = sb.report()
            assert report.disk_full and "disk" in report.limits_hit
            assert 28 * MiB < report.disk_used_bytes <= 32 * MiB
            assert (await sb.exec("rm /tmp/fill && echo x > /tmp/small && cat /tmp/small"))[1] == "x\n"

    run(case())


def test_network_attempts_are_blocked_and_counted():
    async def case():
        async with LocalSandbox(limits=limits()) as sb:
            start = time.monotonic()
            connect = "import socket; socket.create_connection(('{}', 80), timeout=5)"
            code, _, err = await sb.exec(f'python3 -c "{connect.format("1.1.1.1")}"')
            assert code == 1 and "Network is unreachable" in err
            assert "[sandbox] network blocked: 1 attempt(s)" in err
            code, _, err = await sb.exec(f'python3 -c "{connect.format("2606:4700:4700::1111")}"')  # IPv6 too
            assert code == 1 and "Network is unreachable" in err and "network blocked: 1 attempt(s)" in err
            code, _, err = await sb.exec("getent hosts github.com")  # no name server: fails at once
            assert code == 2
            assert time.monotonic() - start < 10
            report = sb.report()
            assert report.network_blocked_attempts == 2 and "network" in report.limits_hit

    run(case())


def test_episode_clock_kills_everything_and_refuses_later_commands():
    async def case():
        async with LocalSandbox(limits=limits(episode_time_budget_sec=2)) as sb:
            await sb.exec("setsid sleep 1000 < /dev/null > /dev/null 2>&1 &", check=True)
            await sb.write_file("/tmp/kept", "state")
            code, _, err = await sb.exec("sleep 30", timeout=60)
            assert code == 137  # killed at the deadline, not at its own end
            await asyncio.sleep(0.2)
            assert sorted(sb._cgroup.pids()) == sorted({sb.init_pid, sb._init_proc.pid})
            code, out, err = await sb.exec("echo late")
            assert (code, out) == (EXIT_TIME_BUDGET_EXCEEDED, "")
            assert "wall-clock budget of 2s is spent" in err
            report = sb.report()
            assert report.episode_time_exceeded and "episode_time" in report.limits_hit
            assert report.episode_seconds >= 2

    run(case())
