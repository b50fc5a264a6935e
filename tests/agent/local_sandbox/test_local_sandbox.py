"""LocalSandbox as slime's Sandbox: users, file round trips, what the sandbox can and cannot see of the host, the
detached exec_and_wait handshake against a real sandbox, and a clean teardown. Real namespaces, real processes."""

import asyncio
import hashlib
import os
from pathlib import Path

import pytest

from slime.agent import sandbox as sandbox_mod
from slime.agent.local_sandbox import LocalSandbox, SandboxLimits
from slime.agent.local_sandbox.host import ID_BASE
from slime.agent.sandbox import EXIT_TIME_BUDGET_EXCEEDED, Sandbox, ensure_agent_user, exec_and_wait

SMALL = SandboxLimits(memory_bytes=512 << 20, disk_bytes=128 << 20, max_processes=64, cpu_time_sec=60,
                      episode_time_budget_sec=300)


def run(coro):
    return asyncio.run(coro)


def test_users_are_unprivileged_host_ids_and_agent_user_is_provisioned():
    async def case():
        async with LocalSandbox(limits=SMALL) as sb:
            assert isinstance(sb, Sandbox)
            assert sb.sandbox_id.startswith("local-")
            code, out, _ = await sb.exec("id -u; echo $HOME; pwd")
            assert (code, out.split()) == (0, ["0", "/root", "/root"])
            # root inside the sandbox is an unprivileged id on the host
            host_uid = int(next(line for line in Path(f"/proc/{sb.init_pid}/status").read_text().splitlines()
                                if line.startswith("Uid:")).split()[1])
            assert host_uid >= ID_BASE
            await sb.exec("mkdir -p /workspace/repo", check=True)
            await ensure_agent_user(sb, "/workspace/repo")
            await ensure_agent_user(sb, "/workspace/repo")  # idempotent
            code, out, _ = await sb.exec("id -un; id -u; echo $HOME; pwd; stat -c %U /workspace/repo", user="agent")
            assert code == 0 and out.split() == ["agent", "1000", "/home/agent", "/home/agent", "agent"]
            # the agent is not root: root's home and the read-only host /usr are closed to it
            code, _, err = await sb.exec("touch /root/x", user="agent")
            assert code == 1 and "Permission denied" in err
            code, _, err = await sb.exec("touch /usr/bin/x", user="root")
            assert code == 1 and "Read-only file system" in err
            # /usr/local is the sandbox's own (npm -g installs there)
            assert (await sb.exec("mkdir -p /usr/local/lib/x && touch /usr/local/bin/tool"))[0] == 0
            code, out, _ = await sb.exec('echo "$A|$B"', user="agent", env={"A": "1 2", "B": "it's \"q\"\n"})
            assert out == "1 2|it's \"q\"\n\n"
            with pytest.raises(ValueError, match="not a valid environment variable name"):
                await sb.exec("true", env={"A=B": "x"})
            code, _, err = await sb.exec("true", user="ghost")
            assert code == 126 and "no such user" in err
            with pytest.raises(RuntimeError, match="exit=3"):
                await sb.exec("exit 3", check=True)

    run(case())


def test_file_round_trips_text_bytes_and_host_paths(tmp_path):
    payload = bytes(range(256)) * 4096 + os.urandom(1 << 20)  # every byte value, ~2 MiB
    host_file = tmp_path / "blob.bin"
    host_file.write_bytes(payload)

    async def case():
        async with LocalSandbox(limits=SMALL) as sb:
            await sb.exec("mkdir -p /workspace && useradd -m agent && chown agent /workspace", check=True)
            text = "héllo\nwörld\t$HOME `id` 'quoted'\n"
            await sb.write_file("/workspace/deep/dir/a.txt", text, user="agent")
            assert await sb.read_file("/workspace/deep/dir/a.txt", user="agent") == text
            await sb.write_file("/tmp/blob", payload)
            await sb.write_file("/tmp/blob-from-path", host_file)
            for path in ("/tmp/blob", "/tmp/blob-from-path"):
                code, out, _ = await sb.exec(f"sha256sum {path}")
                assert out.split()[0] == hashlib.sha256(payload).hexdigest()
            owner = (await sb.exec("stat -c %U /workspace/deep/dir/a.txt"))[1].strip()
            assert owner == "agent"
            assert await sb.read_file("/no/such/file") == ""
            await sb.write_file("/root/secret", "s")
            assert await sb.read_file("/root/secret", user="agent") == ""  # the agent may not read it
            with pytest.raises(RuntimeError, match="Permission denied"):
                await sb.write_file("/root/other", "x", user="agent")

    run(case())


def test_host_is_out_of_sight_and_sandboxes_are_apart(tmp_path):
    marker = tmp_path / "host-marker"
    marker.write_text("host")

    async def case():
        async with LocalSandbox(limits=SMALL) as a, LocalSandbox(limits=SMALL) as b:
            code, _, _ = await a.exec(f"test -e {marker}")
            assert code == 1
            assert (await a.exec("test -e /work"))[0] == 1
            # only the sandbox's own processes: its PID 1 and this command's
            code, out, _ = await a.exec("ls /proc | grep -c '^[0-9]'")
            assert int(out) <= 4
            assert (await a.exec("hostname"))[1].strip() == "sandbox"
            await a.write_file("/tmp/only-in-a", "a")
            assert await b.read_file("/tmp/only-in-a") == ""
            assert a.init_pid != b.init_pid
            uid = {}
            for sb in (a, b):
                await sb.exec("sleep 30 > /dev/null 2>&1 &", user="root")
                uid[sb] = Path(f"/proc/{sb.init_pid}/status").read_text().split("Uid:")[1].split()[0]
            assert uid[a] != uid[b]  # separate host id ranges

    run(case())


def test_exec_and_wait_in_a_real_sandbox(monkeypatch):
    monkeypatch.setattr(sandbox_mod, "MARKER_POLL_INTERVAL_SEC", 0.2)

    async def case():
        async with LocalSandbox(limits=SMALL) as sb:
            await sb.exec("mkdir -p /workspace/repo", check=True)
            await ensure_agent_user(sb, "/workspace/repo")
            code, out = await exec_and_wait(sb, cmd='echo "in $PWD as $(id -un) with $TOKEN"; sh -c "exit 3"',
                                            time_budget_sec=30, tag="job", user="agent", env={"TOKEN": "t0k"},
                                            workdir="/workspace/repo")
            assert (code, out) == (3, "in /workspace/repo as agent with t0k\n")
            code, out = await exec_and_wait(sb, cmd="echo again", time_budget_sec=30, tag="job", user="agent",
                                            want_output=True)
            assert (code, out) == (0, "again\n")
            code, _ = await exec_and_wait(sb, cmd="sleep 60", time_budget_sec=1, tag="slow")
            assert code == EXIT_TIME_BUDGET_EXCEEDED

    run(case())


def test_exec_timeout_kills_the_command():
    async def case():
        async with LocalSandbox(limits=SMALL) as sb:
            code, _, err = await sb.exec("sleep 100", timeout=1)
            assert code == 124 and "timed out after 1s" in err
            states = (await sb.exec("ps -C sleep -o stat="))[1].split()
            assert all(state.startswith("Z") for state in states), states  # killed (a zombie at most)

    run(case())


def test_teardown_leaves_nothing_behind():
    async def case():
        sb = LocalSandbox(limits=SMALL)
        async with sb:
            await sb.exec("setsid sleep 1000 < /dev/null > /dev/null 2>&1 &", check=True)
            init_pid = sb.init_pid
            cgroup_dirs = {sb._cgroup.memory_dir, sb._cgroup.pids_dir}
            root_dir = sb._root_dir
            pids = sb._cgroup.pids()
            assert len(pids) >= 3
        assert not any(Path(f"/proc/{pid}").exists() for pid in pids)
        assert not Path(f"/proc/{init_pid}").exists()
        assert not any(d.exists() for d in cgroup_dirs)
        assert not Path(root_dir).exists()
        with pytest.raises(RuntimeError, match="not running"):
            await sb.exec("true")

    run(case())


def test_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="cannot pull an image"):
        LocalSandbox("ubuntu:22.04")
    with pytest.raises(ValueError, match="memory_bytes"):
        SandboxLimits(memory_bytes=256 << 20, disk_bytes=256 << 20)
    with pytest.raises(ValueError, match="allowed_port"):
        LocalSandbox(allowed_port=70000)
