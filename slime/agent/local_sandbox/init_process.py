"""The first process of a local sandbox, run by `LocalSandbox` as `python init_process.py '<json config>'` (by path,
standard library only): it makes the namespaces, builds the sandbox's filesystem and then stays as the sandbox's
PID 1, reaping orphans, until it is killed.

Steps, and the line each prints on stdout for the host:
1. unshare user, mount, PID, network, IPC and UTS namespaces; print `unshared`; wait for `go` on stdin (meanwhile the
   host, root outside, writes the user namespace's uid/gid maps: sandbox ids 0..65535 -> host ids base..base+65535,
   so sandbox root and every sandbox user are unprivileged host ids of their own).
2. become uid 0 inside; fork the PID-1 process; print `pid <host pid>`.
3. PID 1: a size-limited tmpfs as the new root (the disk limit), the host's /usr read-only, a fresh writable
   /usr/local, a private /etc (the host's world-readable files, its own passwd/group/shadow with root and nobody
   only), /tmp, /home, /root, /var, minimal /dev, /proc of the new PID namespace; loopback up; pivot_root (the host's
   tree is then out of reach); print `ready` (or `error <message>`).

Both processes die with their parent (PR_SET_PDEATHSIG), so a sandbox does not outlive a trainer that crashed.

What it is not: the limits' enforcement (cgroups and rlimits are set by the host before this runs) or the network
forwarding (the host opens the one allowed port inside the network namespace).
"""

import ctypes
import fcntl
import json
import os
import signal
import socket
import stat
import struct
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG = 1
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
SKIPPED_ETC = {"passwd", "group", "shadow", "gshadow", "passwd-", "group-", "shadow-", "gshadow-", "subuid",
               "subgid", "hosts", "hostname", "resolv.conf", "mtab"}

libc = ctypes.CDLL(None, use_errno=True)


def check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def mount(source, target, fstype, flags, data=None) -> None:
    def encode(s):
        return s.encode() if s is not None else None

    check(libc.mount(encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags), encode(data)),
          f"mount {source} on {target}")


def bind(source: str, target: str, *, read_only: bool) -> None:
    mount(source, target, None, MS_BIND | MS_REC)
    if read_only:
        mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def copy_world_readable_etc(target: str) -> None:
    """What an unprivileged host user could read of /etc, minus the account databases (written fresh)."""
    for dirpath, dirnames, filenames in os.walk("/etc"):
        relative = os.path.relpath(dirpath, "/etc")
        dest_dir = os.path.join(target, relative) if relative != "." else target
        for name in list(dirnames) + filenames:
            source = os.path.join(dirpath, name)
            dest = os.path.join(dest_dir, name)
            if relative == "." and name in SKIPPED_ETC:
                dirnames[:] = [d for d in dirnames if d != name]
                continue
            try:
                info = os.lstat(source)
                if stat.S_ISLNK(info.st_mode):
                    os.symlink(os.readlink(source), dest)
                elif stat.S_ISDIR(info.st_mode):
                    if info.st_mode & stat.S_IROTH and info.st_mode & stat.S_IXOTH:
                        os.mkdir(dest, 0o755)
                    else:
                        dirnames[:] = [d for d in dirnames if d != name]
                elif stat.S_ISREG(info.st_mode) and info.st_mode & stat.S_IROTH:
                    with open(source, "rb") as src, open(dest, "wb") as dst:
                        dst.write(src.read())
                    os.chmod(dest, info.st_mode & 0o755)
            except OSError:
                if name in dirnames:
                    dirnames.remove(name)


def write(path: str, text: str, mode: int = 0o644) -> None:
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, mode)


def build_root(root: str, config: dict) -> None:
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, f"size={config['disk_bytes']},mode=755")
    for name, mode in [("usr", 0o755), ("etc", 0o755), ("tmp", 0o1777), ("home", 0o755), ("root", 0o700),
                       ("var", 0o755), ("var/tmp", 0o1777), ("var/mail", 0o2775), ("proc", 0o555), ("dev", 0o755),
                       ("dev/pts", 0o755), ("dev/shm", 0o1777), ("run", 0o755), (".usr-local", 0o755)]:
        os.mkdir(os.path.join(root, name))
        os.chmod(os.path.join(root, name), mode)
    for name in ("bin", "lib", "lib32", "lib64", "libx32", "sbin"):
        host = f"/{name}"
        if os.path.islink(host):
            os.symlink(os.readlink(host), os.path.join(root, name))
        elif os.path.isdir(host):
            os.mkdir(os.path.join(root, name))
            bind(host, os.path.join(root, name), read_only=True)
    bind("/usr", os.path.join(root, "usr"), read_only=True)
    for name in ("bin", "lib", "share", "include", "sbin", "etc"):
        os.mkdir(os.path.join(root, ".usr-local", name))
    bind(os.path.join(root, ".usr-local"), os.path.join(root, "usr/local"), read_only=False)
    for host_path, sandbox_path in config.get("read_only_mounts", {}).items():
        target = os.path.join(root, sandbox_path.lstrip("/"))
        if os.path.isdir(host_path):
            os.makedirs(target, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            open(target, "a").close()
        bind(host_path, target, read_only=True)

    etc = os.path.join(root, "etc")
    copy_world_readable_etc(etc)
    write(f"{etc}/passwd", "root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:"
                           "/usr/sbin/nologin\n")
    write(f"{etc}/group", "root:x:0:\nusers:x:100:\nnogroup:x:65534:\n")
    write(f"{etc}/shadow", "root:*:19000:0:99999:7:::\nnobody:*:19000:0:99999:7:::\n", 0o640)
    write(f"{etc}/gshadow", "root:*::\nusers:*::\nnogroup:*::\n", 0o640)
    write(f"{etc}/hosts", "127.0.0.1 localhost sandbox\n::1 localhost\n")
    write(f"{etc}/hostname", "sandbox\n")
    write(f"{etc}/resolv.conf", "")  # no name server: lookups fail at once instead of waiting

    dev = os.path.join(root, "dev")
    for name in DEVICES:
        open(os.path.join(dev, name), "w").close()
        bind(f"/dev/{name}", os.path.join(dev, name), read_only=False)
    mount("devpts", f"{dev}/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620")
    os.symlink("pts/ptmx", f"{dev}/ptmx")
    for name, target in [("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")]:
        os.symlink(target, f"{dev}/{name}")
    mount("proc", os.path.join(root, "proc"), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)

    libc.sethostname(b"sandbox", 7)
    loopback_up()
    pivot_root(root)


def loopback_up() -> None:
    SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


def pivot_root(root: str) -> None:
    number = SYS_PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        raise OSError(f"pivot_root: no syscall number known for {os.uname().machine}")
    os.mkdir(os.path.join(root, ".oldroot"))
    os.chdir(root)
    check(libc.syscall(number, b".", b".oldroot"), "pivot_root")
    os.chdir("/")
    check(libc.umount2(b"/.oldroot", MNT_DETACH), "umount the host root")
    os.rmdir("/.oldroot")


def reap_forever() -> None:
    signal.signal(signal.SIGCHLD, lambda *_: None)
    devnull = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.closerange(3, 1 << 16)
    while True:
        try:
            os.wait()
        except ChildProcessError:
            signal.pause()
        except InterruptedError:
            pass


def main() -> None:
    config = json.loads(sys.argv[1])
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS),
          "unshare")
    print("unshared", flush=True)
    if sys.stdin.readline().strip() != "go":
        sys.exit(1)
    os.setresgid(0, 0, 0)
    os.setgroups([])
    os.setresuid(0, 0, 0)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # a change of uid clears it: set it again
    pid = os.fork()
    if pid == 0:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        try:
            build_root(config["root_dir"], config)
        except OSError as e:  # reported to the host, which raises it
            print(f"error {type(e).__name__}: {e}", flush=True)
            os._exit(1)
        print("ready", flush=True)
        reap_forever()
    print(f"pid {pid}", flush=True)
    _, status = os.waitpid(pid, 0)
    sys.exit(os.waitstatus_to_exitcode(status) & 0xFF)


if __name__ == "__main__":
    main()
