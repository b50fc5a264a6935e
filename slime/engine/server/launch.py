"""Start `python -m slime.engine.server` as a child process and wait until it answers GET /health.

For tests, benchmarks and launchers that want a real engine server on this host. Not a process supervisor: no
restarts, no log rotation; the caller owns the process and calls `stop()`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from slime.utils.misc import find_free_port
from slime.utils.parent_death import die_with_parent

DEFAULT_STARTUP_TIMEOUT_S = 120.0


class ServerProcess:
    def __init__(self, process: subprocess.Popen, url: str, log_path: Path | None):
        self.process = process
        self.url = url
        self.log_path = log_path

    def log_tail(self, num_chars: int = 4000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def launch_server(
    model_path: str | Path,
    host: str = "127.0.0.1",
    port: int | None = None,
    extra_args: list[str] | None = None,
    log_path: str | Path | None = None,
    env: dict | None = None,
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
) -> ServerProcess:
    """Start the built-in engine server and block until GET /health returns 200."""
    port = port or find_free_port(host)
    command = [sys.executable, "-m", "slime.engine.server", "--model-path", str(model_path)]
    command += ["--host", host, "--port", str(port), *(extra_args or [])]
    return launch_process(command, f"http://{host}:{port}", log_path, env, startup_timeout_s)


def launch_process(command: list[str], url: str, log_path: str | Path | None = None, env: dict | None = None,
                   startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S) -> ServerProcess:
    """Start any server speaking the engine HTTP API (the built-in one, or SGLang) at `url` and block until
    GET /health returns 200; RuntimeError (with the log tail) if it exits or does not become healthy in time. The
    server is SIGKILLed when the calling process dies (`slime.utils.parent_death`)."""
    log_path = Path(log_path) if log_path else None
    log_file = open(log_path, "w") if log_path else subprocess.DEVNULL
    child_env = {**os.environ, **(env or {})}
    repo_root = str(Path(__file__).resolve().parents[2])
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (repo_root, child_env.get("PYTHONPATH")) if p)
    process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=child_env,
                               preexec_fn=die_with_parent())
    if log_path:
        log_file.close()
    server = ServerProcess(process, url, log_path)
    deadline = time.monotonic() + startup_timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"engine server exited with code {process.returncode}:\n{server.log_tail()}")
        try:  # trust_env=False: an http_proxy must not capture loopback
            if httpx.get(server.url + "/health", timeout=2.0, trust_env=False).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"engine server not healthy after {startup_timeout_s} s:\n{server.log_tail()}")
