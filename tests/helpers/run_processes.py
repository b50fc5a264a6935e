"""A real `train.py` run for the socket and lifetime tests: started in its own process group, with every process
of its tree recorded while it runs (Ray's GCS, raylet, workers, the engine servers and the sglang-router are all
descendants of the driver) and every socket those processes listen on."""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]


def small_grpo_argv(task: dict, out: Path, *extra: str) -> list[str]:
    """One rollout of GRPO on the quickstart task: router, one engine, two trainer ranks (gloo), a weight push."""
    return ["--hf-checkpoint", str(task["model"]), "--prompt-data", str(task["train"]), "--input-key", "prompt",
            "--label-key", "label", "--apply-chat-template", "--rollout-batch-size", "2", "--n-samples-per-prompt",
            "2", "--num-rollout", "1", "--rollout-max-response-len", "4", "--actor-num-gpus-per-node", "2",
            "--output-dir", str(out), "--no-progress", *extra]


def start_run(argv: list[str], log_path: Path) -> subprocess.Popen:
    log = open(log_path, "w")
    process = subprocess.Popen([sys.executable, str(REPO / "train.py"), *argv], cwd=REPO, stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    return process


def tree(root_pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(root_pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


@dataclass
class Listener:
    ip: str
    port: int
    kind: str  # "tcp" or "udp"
    cmdline: str


@dataclass
class RunWatch:
    """What a run's process tree did while it was watched: every process seen and every socket listened on."""
    processes: dict[int, psutil.Process] = field(default_factory=dict)
    cmdlines: dict[int, str] = field(default_factory=dict)
    listeners: dict[tuple, Listener] = field(default_factory=dict)

    def sample(self, root_pid: int) -> None:
        for process in tree(root_pid):
            self.processes.setdefault(process.pid, process)
            self._cmdline(process.pid)  # the latest: a Ray worker's title names its actor once it has one
        for conn in psutil.net_connections(kind="inet"):
            unconnected_udp = conn.type == socket.SOCK_DGRAM and conn.laddr and not conn.raddr
            listening = conn.status == psutil.CONN_LISTEN or unconnected_udp
            if listening and conn.pid in self.processes:
                kind = "tcp" if conn.status == psutil.CONN_LISTEN else "udp"
                key = (conn.pid, conn.laddr.ip, conn.laddr.port, kind)
                self.listeners[key] = Listener(conn.laddr.ip, conn.laddr.port, kind, self.cmdlines[conn.pid])

    def _cmdline(self, pid: int) -> None:
        try:
            self.cmdlines[pid] = " ".join(self.processes[pid].cmdline()).strip()[:200]
        except psutil.Error:
            self.cmdlines.setdefault(pid, "?")

    def alive(self) -> list[str]:
        """Processes of the run still running (a pid reused by an unrelated process does not count)."""
        left = []
        for pid, process in self.processes.items():
            try:
                if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                    left.append(self.cmdlines[pid])
            except psutil.NoSuchProcess:
                pass
        return left


def watch(process: subprocess.Popen, timeout: float, until=None, interval: float = 0.5) -> RunWatch:
    """Sample the run's tree until it exits, `until(watch)` is true, or `timeout` passes."""
    result = RunWatch()
    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        result.sample(process.pid)
        if until is not None and until(result):
            break
        time.sleep(interval)
    return result


def wait_gone(watched: RunWatch, timeout: float) -> list[str]:
    """Wait up to `timeout` for the run's processes to exit; returns those still alive."""
    deadline = time.monotonic() + timeout
    while watched.alive() and time.monotonic() < deadline:
        time.sleep(0.5)
    return watched.alive()


def kill_leftovers(watched: RunWatch) -> None:
    """Clean up after a failed test: SIGKILL each process of the run that is still alive, by pid."""
    for process in watched.processes.values():
        try:
            if process.is_running():
                process.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass


def kill_group(process: subprocess.Popen) -> None:
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
