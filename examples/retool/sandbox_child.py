"""The sandboxed process's own first steps (run as `python -I sandbox_child.py LIMITS_JSON`, inside a new network
namespace where there is one): set the resource limits, drop root, refuse escapes through an audit hook, then run
`main.py` from the scratch directory (its working directory). Only the standard library: this file is the child.

The audit hook turns what the sandbox does not allow into a PermissionError with a clear message: writes, renames
and deletions outside the scratch directory, sockets, new processes, signals to other processes, and ctypes calls
into native code. It is the readable layer; the process-level limits (rlimits, no network, an unprivileged user,
the parent's wall-clock kill) are what hold for code that gets past Python.
"""

import json
import os
import resource
import signal
import sys
import traceback

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
PATH_EVENTS = {"os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.chmod": (0,), "os.chown": (0,),
               "os.utime": (0,), "os.truncate": (0,), "os.rename": (0, 1), "os.link": (0, 1), "os.symlink": (1,),
               "shutil.rmtree": (0,), "shutil.copyfile": (1,), "shutil.copytree": (1,), "shutil.move": (1,)}
PROCESS_EVENTS = {"os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "subprocess.Popen",
                  "pty.spawn", "os.kill", "os.killpg", "signal.pthread_kill"}
NETWORK_EVENTS = {"socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.gethostbyname",
                  "socket.gethostbyaddr", "socket.sendto"}
# Modules that reach the network, processes or native calls; a fresh import is an ImportError (so libraries that
# try one optionally, as numpy does ctypes, still import).
BLOCKED_MODULES = {"socket", "_socket", "ssl", "_ssl", "subprocess", "_posixsubprocess", "multiprocessing",
                   "_multiprocessing", "pty", "ctypes", "_ctypes"}
NATIVE_EVENTS = {"ctypes.dlsym", "ctypes.call_function", "ctypes.cdata", "ctypes.string_at", "ctypes.wstring_at"}


def set_limits(limits: dict) -> None:
    cpu_s = max(1, int(limits["cpu_seconds"]))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))  # SIGXCPU at the soft limit, SIGKILL at the hard
    memory = int(limits["memory_bytes"])
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    file_size = int(limits["file_size_bytes"])
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the file-size limit fails with EFBIG instead


def drop_privileges(uid: int) -> None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def make_audit_hook(scratch: str):
    def inside_scratch(path) -> bool:
        if isinstance(path, int):  # an open file descriptor: it was checked when it was opened
            return True
        resolved = os.path.realpath(os.fsdecode(path))
        return resolved == scratch or resolved.startswith(scratch + os.sep)

    def hook(event: str, args: tuple) -> None:
        if event == "import":
            if args[0] in BLOCKED_MODULES:
                raise ImportError(f"sandbox: importing {args[0]} is disabled (no network, processes or native calls)")
        elif event == "open":
            path, mode, flags = args
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                (isinstance(flags, int) and flags & WRITE_FLAGS)
            if writes and path is not None and not inside_scratch(path):
                raise PermissionError(f"sandbox: writing outside the scratch directory is not allowed ({path})")
        elif event in PATH_EVENTS:
            for position in PATH_EVENTS[event]:
                if position < len(args) and args[position] is not None and not inside_scratch(args[position]):
                    raise PermissionError(f"sandbox: {event} outside the scratch directory is not allowed "
                                          f"({args[position]})")
        elif event in NETWORK_EVENTS:
            raise PermissionError("sandbox: network access is disabled")
        elif event in PROCESS_EVENTS:
            raise PermissionError(f"sandbox: starting or signalling processes is disabled ({event})")
        elif event in NATIVE_EVENTS:
            raise PermissionError(f"sandbox: calling native code through ctypes is disabled ({event})")

    return hook


def main() -> None:
    limits = json.loads(sys.argv[1])
    scratch = os.path.realpath(os.getcwd())
    set_limits(limits)
    if limits.get("drop_to_uid") is not None:
        drop_privileges(int(limits["drop_to_uid"]))
    with open("main.py") as source:
        code = compile(source.read(), "main.py", "exec")
    sys.dont_write_bytecode = True
    sys.argv = ["main.py"]
    sys.addaudithook(make_audit_hook(scratch))
    try:
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    except MemoryError:
        sys.stdout.flush()
        print(f"MemoryError: the code went past the sandbox's memory limit of {limits['memory_bytes'] >> 20} MB",
              file=sys.stderr)
        sys.exit(1)
    except SystemExit:
        raise
    except BaseException as error:  # noqa: BLE001 - shown to the model as Python would show it
        sys.stdout.flush()
        print_user_traceback(error)
        sys.exit(1)


def print_user_traceback(error: BaseException) -> None:
    """The traceback without this file's frames (the exec call, the audit hook)."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename != __file__]
    lines = (["Traceback (most recent call last):\n"] if frames else []) + traceback.format_list(frames)
    sys.stderr.write("".join(lines + traceback.format_exception_only(type(error), error)))


if __name__ == "__main__":
    main()
