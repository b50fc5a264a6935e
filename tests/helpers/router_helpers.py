"""The real sglang-router for tests: launch one, register a worker with it, stop it (test_rollout and
test_rollout_engine)."""

import subprocess

from slime.ray.router import RouterProcess
from slime.ray.router import register_worker as router_register_worker


def launch_router(port: int) -> subprocess.Popen:
    return RouterProcess(port=port, policy="round_robin").process


def register_worker(router_port: int, worker_url: str, timeout_s: float = 60) -> None:
    router_register_worker(f"http://127.0.0.1:{router_port}", worker_url, timeout=timeout_s)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
