"""Run untrusted Python in a separate, limited process: the ReTool example's code interpreter.

`run_code(code)` writes the code to a fresh scratch directory and runs it there in its own process with:
- a wall-clock limit (the parent kills the whole process group) and a CPU-time limit (RLIMIT_CPU);
- a memory limit (RLIMIT_AS), so a 10 GB allocation is a MemoryError, not a swapping machine;
- no network: a new, empty network namespace (`unshare -n`) when this process may create one (root; else
  `unshare -rn` where unprivileged user namespaces are enabled), plus an audit hook refusing socket creation;
- no writes outside the scratch directory: an audit hook refuses writes, renames and deletions outside it
  (`sandbox_child.py`), and the code runs as `nobody` when we are root and `nobody` can read the interpreter's
  standard library (`unprivileged_uid`); RLIMIT_FSIZE caps every file it writes;
- no new processes (audit hook); output cut to `max_output_chars` (its two ends); the scratch directory deleted
  afterwards.
Every failure (time, memory, refused call, exception) comes back as text in `SandboxResult.output`; `run_code`
itself raises only for a bad argument. Not a security boundary against a determined attacker with a kernel exploit
(use gVisor / nsjail / a VM for that); a boundary against what a policy model writes by accident or by reward
hacking.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

CHILD = Path(__file__).with_name("sandbox_child.py")
NOBODY_UID = 65534
KILL_GRACE_S = 0.5


@dataclass(frozen=True)
class SandboxLimits:
    wall_seconds: float = 5.0
    cpu_seconds: int = 5
    memory_mb: int = 1024
    file_size_mb: int = 16
    max_output_chars: int = 2000


@dataclass
class SandboxResult:
    output: str  # stdout and stderr interleaved, cut to max_output_chars, error notes appended
    exit_code: int | None  # None: killed at the wall-clock limit
    timed_out: bool
    seconds: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


def readable_by_everyone(path: str) -> bool:
    """Whether a user with no rights of its own can read `path` (every directory above it searchable)."""
    path = os.path.realpath(path)
    if not os.stat(path).st_mode & stat.S_IROTH:
        return False
    while path != os.path.dirname(path):
        path = os.path.dirname(path)
        if not os.stat(path).st_mode & stat.S_IXOTH:
            return False
    return True


@functools.lru_cache(maxsize=1)
def unprivileged_uid() -> int | None:
    """The uid the code runs as: `nobody` when we are root and `nobody` can read this interpreter's standard
    library (it cannot when Python lives under a private home, e.g. pyenv in /root); else None (our own uid)."""
    if os.geteuid() != 0:
        return None
    if not readable_by_everyone(sysconfig.get_paths()["stdlib"]):
        logger.warning("retool sandbox: user nobody cannot read %s, so the code runs as root (in its own network "
                       "namespace, with the audit hook's write block)", sysconfig.get_paths()["stdlib"])
        return None
    return NOBODY_UID


@functools.lru_cache(maxsize=1)
def network_isolation() -> tuple[list[str], int | None]:
    """(command prefix that gives the child an empty network namespace, uid to drop to), probed once."""
    unshare = shutil.which("unshare")
    drop_to = unprivileged_uid()
    if unshare is not None:
        for prefix, uid in (([unshare, "-n"], drop_to), ([unshare, "-rn"], None)):
            probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=10)
            if probe.returncode == 0:
                return prefix, uid
    logger.warning("retool sandbox: cannot create a network namespace (no root, no user namespaces); the code "
                   "runs with the audit hook's socket block only")
    return [], drop_to


def run_code(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    if not isinstance(code, str):
        raise ValueError(f"code must be a string, got {type(code).__name__}")
    prefix, drop_to_uid = network_isolation()
    scratch = tempfile.mkdtemp(prefix="retool-")
    started = time.perf_counter()
    try:
        Path(scratch, "main.py").write_text(code)
        if drop_to_uid is not None:
            os.chown(scratch, drop_to_uid, drop_to_uid)
        child_limits = {"cpu_seconds": limits.cpu_seconds, "memory_bytes": limits.memory_mb << 20,
                        "file_size_bytes": limits.file_size_mb << 20, "drop_to_uid": drop_to_uid}
        env = {"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "OMP_NUM_THREADS": "1",
               "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "LANG": "C.UTF-8"}
        with tempfile.TemporaryFile() as output:
            process = subprocess.Popen([*prefix, sys.executable, "-I", str(CHILD), json.dumps(child_limits)],
                                       cwd=scratch, env=env, stdin=subprocess.DEVNULL, stdout=output,
                                       stderr=subprocess.STDOUT, start_new_session=True)
            timed_out = False
            try:
                process.wait(timeout=limits.wall_seconds)
            except subprocess.TimeoutExpired:
                timed_out = True
            _kill_group(process)  # also whatever it left behind, timed out or not
            text = _read_ends(output, 2 * limits.max_output_chars)
        return _result(text, None if timed_out else process.returncode, timed_out,
                       time.perf_counter() - started, limits)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _read_ends(file, num_bytes: int) -> str:
    """The file's text, or its first and last `num_bytes` bytes when it is longer (cut further by `_result`)."""
    size = os.fstat(file.fileno()).st_size
    file.seek(0)
    if size <= 2 * num_bytes:
        return file.read().decode("utf-8", errors="replace")
    head = file.read(num_bytes)
    file.seek(size - num_bytes)
    return (head + file.read()).decode("utf-8", errors="replace")


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        process.wait(timeout=KILL_GRACE_S + 5)
    except subprocess.TimeoutExpired:  # unkillable (stuck in the kernel): do not wait for it
        logger.warning("retool sandbox: process %d did not exit after SIGKILL", process.pid)


def _result(text: str, exit_code: int | None, timed_out: bool, seconds: float,
            limits: SandboxLimits) -> SandboxResult:
    if len(text) > limits.max_output_chars:  # keep both ends: an error is at the end of the output
        half = limits.max_output_chars // 2
        text = f"{text[:half]}\n[output cut to its first and last {half} characters]\n{text[-half:]}"
    notes = []
    if timed_out:
        notes.append(f"Error: the code ran past the {limits.wall_seconds:g} s time limit and was stopped.")
    elif exit_code in (-signal.SIGXCPU, -signal.SIGKILL):
        notes.append(f"Error: the code used more than {limits.cpu_seconds} s of CPU time and was stopped.")
    elif exit_code is not None and exit_code < 0:
        notes.append(f"Error: the code was killed by signal {signal.Signals(-exit_code).name}.")
    elif exit_code not in (0, None) and not text.strip():
        notes.append(f"Error: the code exited with status {exit_code}.")
    if notes:
        text = (text.rstrip("\n") + "\n" if text.strip() else "") + "\n".join(notes)
    return SandboxResult(text, exit_code, timed_out, seconds)
