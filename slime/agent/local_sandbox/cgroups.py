"""The control group of one local sandbox: its memory and process-count limits, and the counters that say whether
they were hit. cgroup v1 (separate `memory` and `pids` hierarchies) and v2 (one unified hierarchy) both work; the
group is made under the cgroup this process is in, so a container's own limits still hold above it.

What it is not: the namespaces or the file tree (init_process.py), nor the per-process rlimits (local.py).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


class CgroupUnavailable(RuntimeError):
    """No writable memory and pids cgroup here: the sandbox's limits cannot be enforced."""


def _own_cgroup_paths() -> dict[str, str]:
    """controller (or "" for the v2 hierarchy) -> this process's path in it, from /proc/self/cgroup."""
    paths = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            paths[controller] = path
    return paths


def _v2_root() -> Path | None:
    for candidate in (CGROUP_ROOT, CGROUP_ROOT / "unified"):
        if (candidate / "cgroup.controllers").is_file():
            return candidate
    return None


GROUP_PREFIX = "slime-local-"
STALE_AFTER_SEC = 60.0


def _group_parents() -> set[Path]:
    """The folders this process makes its sandboxes' groups in (one per hierarchy)."""
    own = _own_cgroup_paths()
    parents = {CGROUP_ROOT / c / own[c].lstrip("/") for c in ("memory", "pids") if c in own}
    v2 = _v2_root()
    if v2 is not None and "" in own:
        parents.add(v2 / own[""].lstrip("/"))
    return parents


def group_exists(name: str) -> bool:
    return any((parent / name).is_dir() for parent in _group_parents())


def sweep_stale_groups(min_age_sec: float = STALE_AFTER_SEC) -> list[Path]:
    """Remove the empty groups that sandboxes of a crashed process left behind, next to where this process makes
    its own (only those older than `min_age_sec`: a group being made is empty for a moment). Returns them."""
    removed = []
    for parent in _group_parents():
        for folder in parent.glob(f"{GROUP_PREFIX}*"):
            try:
                stale = time.time() - folder.stat().st_ctime >= min_age_sec
                if stale and not (folder / "cgroup.procs").read_text().strip():
                    folder.rmdir()
                    removed.append(folder)
            except OSError:
                continue  # in use again, or gone meanwhile
    return removed


@dataclass
class SandboxCgroup:
    """memory_dir and pids_dir are the same folder on cgroup v2."""

    memory_dir: Path
    pids_dir: Path
    version: int

    @classmethod
    def create(cls, name: str, *, memory_bytes: int, max_processes: int) -> SandboxCgroup:
        own = _own_cgroup_paths()
        problems = []
        if (CGROUP_ROOT / "memory").is_dir() and (CGROUP_ROOT / "pids").is_dir() and "memory" in own and "pids" in own:
            memory_dir = CGROUP_ROOT / "memory" / own["memory"].lstrip("/") / name
            pids_dir = CGROUP_ROOT / "pids" / own["pids"].lstrip("/") / name
            try:
                memory_dir.mkdir()
                pids_dir.mkdir()
                group = cls(memory_dir, pids_dir, version=1)
                (memory_dir / "memory.limit_in_bytes").write_text(str(memory_bytes))
                if (memory_dir / "memory.memsw.limit_in_bytes").exists():
                    try:
                        (memory_dir / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
                    except OSError:
                        pass  # swap accounting off: there is no swap to escape into
                (pids_dir / "pids.max").write_text(str(max_processes))
                return group
            except OSError as e:
                for folder in (memory_dir, pids_dir):
                    if folder.is_dir():
                        folder.rmdir()
                problems.append(f"cgroup v1 memory/pids: {e}")
        v2 = _v2_root()
        if v2 is not None and "" in own:
            parent = v2 / own[""].lstrip("/")
            folder = parent / name
            try:
                enabled = set((parent / "cgroup.subtree_control").read_text().split())
                missing = {"memory", "pids"} - enabled
                if missing:
                    (parent / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in sorted(missing)))
                folder.mkdir()
                (folder / "memory.max").write_text(str(memory_bytes))
                if (folder / "memory.swap.max").exists():
                    (folder / "memory.swap.max").write_text("0")
                (folder / "pids.max").write_text(str(max_processes))
                return cls(folder, folder, version=2)
            except OSError as e:
                if folder.is_dir():
                    folder.rmdir()
                problems.append(f"cgroup v2 at {parent}: {e}")
        raise CgroupUnavailable(
            "the local sandbox needs a writable memory and pids cgroup (v1 or v2) to limit memory and processes: "
            + ("; ".join(problems) or "no cgroup hierarchy with those controllers is mounted at /sys/fs/cgroup")
            + ". Run as root with /sys/fs/cgroup writable (in a container: --cgroupns=private or a delegated "
            "cgroup), or use another sandbox backend."
        )

    def join(self, pid: int) -> None:
        """Move `pid` into the group (children it forks afterwards are in it too)."""
        for folder in {self.memory_dir, self.pids_dir}:
            (folder / "cgroup.procs").write_text(str(pid))

    def pids(self) -> list[int]:
        return [int(p) for p in (self.pids_dir / "cgroup.procs").read_text().split()]

    def oom_kills(self) -> int:
        if self.version == 1:
            text = (self.memory_dir / "memory.oom_control").read_text()
            counters = dict(line.split() for line in text.splitlines())
            if "oom_kill" in counters:
                return int(counters["oom_kill"])
            return int((self.memory_dir / "memory.failcnt").read_text())
        counters = dict(line.split() for line in (self.memory_dir / "memory.events").read_text().splitlines())
        return int(counters.get("oom_kill", 0))

    def process_limit_hits(self) -> int:
        counters = dict(line.split() for line in (self.pids_dir / "pids.events").read_text().splitlines())
        return int(counters.get("max", 0))

    def memory_peak_bytes(self) -> int:
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        path = self.memory_dir / name
        return int(path.read_text()) if path.exists() else 0

    def kill_all(self, keep: set[int] = frozenset()) -> None:
        """SIGKILL every process in the group but those in `keep`, again and again (a fork bomb forks back) until
        none is left, for at most 10 s."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            pids = [pid for pid in self.pids() if pid not in keep]
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)

    def remove(self) -> None:
        self.kill_all()
        for folder in {self.memory_dir, self.pids_dir}:
            for _ in range(50):
                try:
                    folder.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)
