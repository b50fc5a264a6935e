"""What a local sandbox needs from its host and leaves on it: the check that the host can run sandboxes
(`local_sandbox_problems`), the host id ranges sandboxes take (one lock file each, freed when the holder dies) and
the sweep of the root folders a crashed process left behind.

What it is not: a sandbox (local.py) or its control group (cgroups.py).
"""

from __future__ import annotations

import fcntl
import functools
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from slime.agent.local_sandbox.cgroups import STALE_AFTER_SEC, CgroupUnavailable, SandboxCgroup, group_exists

ID_RANGE = 65536
ID_BASE = 2_000_000
NUM_ID_SLOTS = 4096
SLOT_LOCK_DIR = Path(tempfile.gettempdir()) / "slime-sandbox-ids"
HOST_TOOLS = ("nsenter", "prlimit", "setpriv", "bash", "unshare")


class SandboxUnavailable(RuntimeError):
    """This host cannot run local sandboxes (see local_sandbox_problems())."""


def local_sandbox_problems() -> list[str]:
    """Why local sandboxes cannot start here (empty when they can); probed once per process."""
    return list(_probe_host())


@functools.cache
def _probe_host() -> tuple[str, ...]:
    problems = []
    if os.geteuid() != 0:
        problems.append("not root: the local sandbox maps user ids and makes cgroups, which needs root on the host")
    problems += [f"`{tool}` not on PATH (util-linux / bash)" for tool in HOST_TOOLS if shutil.which(tool) is None]
    if problems:
        return tuple(problems)
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "--pid", "--net", "--fork", "true"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        problems.append(f"new user / mount / PID / network namespaces are refused here ({probe.stderr.strip()}): "
                        "allow unprivileged-by-root user namespaces (sysctl user.max_user_namespaces > 0, no "
                        "AppArmor userns restriction), or in a container run it with --privileged")
    try:
        SandboxCgroup.create(f"slime-probe-{uuid.uuid4().hex[:12]}", memory_bytes=64 << 20, max_processes=4).remove()
    except CgroupUnavailable as error:
        problems.append(str(error))
    return tuple(problems)


def sweep_stale_roots(min_age_sec: float = STALE_AFTER_SEC) -> list[Path]:
    """Remove the (empty) root folders of sandboxes whose group is gone: a crashed process left them. A live
    sandbox has its group from before its root folder is made until after it is removed."""
    removed = []
    for folder in Path(tempfile.gettempdir()).glob("slime-local-*"):
        name = folder.name.rsplit("-", 1)[0]  # slime-local-<id>-<mkdtemp suffix> -> its group's name
        try:
            if time.time() - folder.stat().st_mtime >= min_age_sec and not group_exists(name):
                folder.rmdir()
                removed.append(folder)
        except OSError:
            continue  # not empty, or gone meanwhile
    return removed


def acquire_id_slot() -> tuple[int, int]:
    """A host id range no other live sandbox on this machine uses: (lock fd, first host id)."""
    SLOT_LOCK_DIR.mkdir(exist_ok=True)
    for slot in range(NUM_ID_SLOTS):
        fd = os.open(SLOT_LOCK_DIR / f"{slot}.lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd, ID_BASE + slot * ID_RANGE
        except BlockingIOError:
            os.close(fd)
    raise SandboxUnavailable(f"all {NUM_ID_SLOTS} sandbox id ranges are in use on this machine")
