"""`python -m slime.agent.local_sandbox`: the command a user runs to try the sandbox prints the command's output and
a JSON report last, and exits with the command's code."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def sandbox_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slime.agent.local_sandbox", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={"PYTHONPATH": str(REPO), "PATH": "/usr/sbin:/usr/bin:/bin"})


def test_check_then_one_command_with_its_report():
    assert sandbox_cli().stdout == "local sandboxes: available\n"
    result = sandbox_cli("--memory-mb", "256", "--disk-mb", "32", "--user", "nobody", "--",
                         "id -un; dd if=/dev/zero of=/tmp/f bs=1M count=64 2>/dev/null; exit 5")
    lines = result.stdout.splitlines()
    assert result.returncode == 5 and lines[0] == "nobody"
    report = json.loads(lines[-1])
    assert report["exit_code"] == 5 and report["limits_hit"] == ["disk"] and report["disk_full"]
    assert "[sandbox] disk limit of 33554432 bytes reached" in result.stderr
