"""What a local sandbox may use (`SandboxLimits`) and what it did use and hit (`SandboxReport`).

What it is not: the enforcement, which is local.py (rlimits, the episode clock), cgroups.py (memory, processes) and
init_process.py (the disk: a tmpfs of that size).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class SandboxLimits:
    """Every limit is enforced by the kernel; none is advisory.

    memory_bytes: all processes of the sandbox together (cgroup), page cache and the sandbox's files included: its
        disk is RAM-backed, so it must exceed disk_bytes. A process that goes past it is killed (OOM).
    disk_bytes: the size of the sandbox's writable tree (/tmp, /home, /root, /usr/local, /etc, /var...); writes past
        it fail with ENOSPC.
    max_processes: processes and threads alive at once, all users together (cgroup pids.max); a fork past it fails
        with EAGAIN.
    cpu_time_sec: CPU seconds each process may use (RLIMIT_CPU): SIGXCPU at the limit, SIGKILL a second later.
    episode_time_budget_sec: wall-clock seconds from the sandbox's start; at the deadline every process in it is
        killed and later `exec` calls return EXIT_TIME_BUDGET_EXCEEDED.
    max_file_bytes: the largest file a process may write (RLIMIT_FSIZE; SIGXFSZ past it).
    max_open_files: file descriptors per process (RLIMIT_NOFILE).
    """

    memory_bytes: int = 4 * GiB
    disk_bytes: int = 2 * GiB
    max_processes: int = 512
    cpu_time_sec: int = 3600
    episode_time_budget_sec: float = 3600.0
    max_file_bytes: int = 1 * GiB
    max_open_files: int = 4096

    def __post_init__(self) -> None:
        for name in ("memory_bytes", "disk_bytes", "max_processes", "cpu_time_sec", "max_file_bytes",
                     "max_open_files"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"SandboxLimits.{name} must be a positive integer, got {value!r}")
        if not self.episode_time_budget_sec > 0:
            raise ValueError(
                f"SandboxLimits.episode_time_budget_sec must be positive, got {self.episode_time_budget_sec!r}"
            )
        if self.disk_bytes < 16 * MiB:
            raise ValueError(f"SandboxLimits.disk_bytes={self.disk_bytes} is below 16 MiB, too small for the "
                             "sandbox's own /etc and home folders: raise it")
        if self.memory_bytes <= self.disk_bytes + 64 * MiB:
            raise ValueError(
                f"SandboxLimits.memory_bytes={self.memory_bytes} must exceed disk_bytes={self.disk_bytes} by more "
                "than 64 MiB: the sandbox's files live in RAM and count toward its memory. Raise memory_bytes or "
                "lower disk_bytes"
            )
        if self.max_processes < 4:
            raise ValueError(f"SandboxLimits.max_processes={self.max_processes} is below 4: a shell running one "
                             "command needs a few processes. Raise it")


@dataclass
class SandboxReport:
    """What one sandbox used and which limits stopped something, read when asked (`LocalSandbox.report()`).

    oom_kills: processes killed for going past memory_bytes. process_limit_hits: forks refused at max_processes.
    cpu_limit_kills: commands ended by SIGXCPU / SIGKILL at cpu_time_sec, as `exec` saw them.
    disk_full: the writable tree had no free space left at some `exec`'s end.
    network_blocked_attempts: packets the sandbox tried to send to any address but its own loopback (the kernel's
    OutNoRoutes counts, IPv4 and IPv6, of its network namespace: there is no route out).
    refused_loopback_connections: TCP connects inside the sandbox that were refused (a port nothing listens on;
    the allowed port is the only one forwarded to the host).
    episode_time_exceeded: the wall-clock budget ran out and the sandbox's processes were killed.
    """

    memory_peak_bytes: int = 0
    oom_kills: int = 0
    process_limit_hits: int = 0
    cpu_limit_kills: int = 0
    disk_used_bytes: int = 0
    disk_full: bool = False
    network_blocked_attempts: int = 0
    refused_loopback_connections: int = 0
    episode_time_exceeded: bool = False
    episode_seconds: float = 0.0

    @property
    def limits_hit(self) -> list[str]:
        """The names of the limits that stopped something, in a fixed order."""
        hits = [("memory", self.oom_kills > 0), ("processes", self.process_limit_hits > 0),
                ("cpu_time", self.cpu_limit_kills > 0), ("disk", self.disk_full),
                ("network", self.network_blocked_attempts > 0), ("episode_time", self.episode_time_exceeded)]
        return [name for name, hit in hits if hit]

    def to_dict(self) -> dict:
        return {**asdict(self), "limits_hit": self.limits_hit}
