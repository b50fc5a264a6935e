"""The real sglang-router as a child process (it dies with its owner), and worker registration with it.

The router spreads `/generate` requests over the engines; the rollout only ever talks to the router. Registration
uses the router's `POST /workers` API and waits until the worker is listed (the router probes its health first);
`DELETE /workers/{id}` takes one out. As in slime, the router never opens a circuit breaker and runs no health checks
of its own (on a loaded machine they took the only engine out of a healthy run: "no_available_workers"); whether an
engine serves is decided by the run (registration, and under `--use-fault-tolerance` slime's health checks). Under
`--use-fault-tolerance` it does not retry a failed request on another worker either: slime's rollout re-sends the
request itself (and counts it).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from slime.utils.http_utils import worker_urls_from_listing
from slime.utils.misc import find_free_port
from slime.utils.parent_death import die_with_parent


class RouterError(RuntimeError):
    pass


class RouterProcess:
    def __init__(self, host: str = "127.0.0.1", port: int | None = None, policy: str = "cache_aware",
                 request_timeout_secs: int = 14400, api_key: str | None = None, log_path: str | None = None,
                 retries: bool = True, log_level: str = "warn", extra_flags: list[str] | None = None):
        """`extra_flags`: more of sglang-router's own flags (the run's --router-* flags, `router_cli_flags`);
        `retries` False (fault tolerance): a failed request comes back to the rollout, which re-sends it itself."""
        self.host = host
        self.port = port or find_free_port(host)
        self.url = f"http://{host}:{self.port}"
        cmd = [
            sys.executable, "-m", "sglang_router.launch_router",
            "--host", host, "--port", str(self.port), "--policy", policy,
            "--log-level", log_level, "--request-timeout-secs", str(request_timeout_secs),
            "--prometheus-host", host, "--prometheus-port", str(find_free_port(host)), *(extra_flags or []),
        ]
        cmd += ["--disable-circuit-breaker", "--disable-health-check"] + ([] if retries else ["--disable-retries"])
        # With a key the router requires it from its clients and sends it to the engines (sglang-router 0.3.2).
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        cmd += ["--api-key", api_key] if api_key else []
        # Its log goes to a file, never to a pipe: nobody reads a pipe during a run, and a full one stalls the router.
        if log_path:
            Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        self.log_file = open(log_path, "a+b") if log_path else tempfile.TemporaryFile()
        self.process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log_file,
                                        preexec_fn=die_with_parent())
        self._wait_ready()

    def _wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.log_file.seek(0)
                err = self.log_file.read().decode(errors="replace")[-2000:]
                raise RouterError(f"sglang-router exited with code {self.process.returncode}: {err}")
            try:
                if httpx.get(f"{self.url}/workers", headers=self.headers, timeout=1.0,
                             trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.shutdown()
        raise RouterError(f"sglang-router at {self.url} did not become ready within {timeout:.0f} s")

    def exit_code(self) -> int | None:
        """None while the router runs; its exit code (negative: the signal that killed it) once it has ended."""
        return self.process.poll()

    def shutdown(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.log_file.close()


def list_workers(router_url: str, headers: dict | None = None) -> list[str]:
    response = httpx.get(f"{router_url}/workers", headers=headers, timeout=10.0, trust_env=False)
    response.raise_for_status()
    return worker_urls_from_listing(response.json())


def register_worker(router_url: str, worker_url: str, timeout: float = 120.0, api_key: str | None = None) -> None:
    """Add `worker_url` to the router and wait until the router lists it (`api_key`: the router's and the
    worker's key, when they have one)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"url": worker_url, **({"api_key": api_key} if api_key else {})}
    response = httpx.post(f"{router_url}/workers", json=body, headers=headers, timeout=30.0, trust_env=False)
    if response.status_code not in (200, 201, 202):
        raise RouterError(f"router {router_url} refused worker {worker_url}: {response.status_code} {response.text}")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if worker_url in list_workers(router_url, headers):
            return
        time.sleep(0.2)
    raise RouterError(f"router {router_url} did not list worker {worker_url} within {timeout:.0f} s")


def deregister_worker(router_url: str, worker_url: str, api_key: str | None = None) -> bool:
    """Take `worker_url` out of the router at once (new requests stop going to it); False when it was not listed."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(f"{router_url}/workers", headers=headers, timeout=10.0, trust_env=False)
    response.raise_for_status()
    ids = [w["id"] for w in response.json().get("workers", []) if isinstance(w, dict) and w.get("url") == worker_url]
    for worker_id in ids:
        answer = httpx.delete(f"{router_url}/workers/{worker_id}", headers=headers, timeout=10.0, trust_env=False)
        if answer.status_code not in (200, 202, 204, 404):
            raise RouterError(f"router {router_url} refused to remove worker {worker_url}: "
                              f"{answer.status_code} {answer.text}")
    deadline = time.monotonic() + 10.0  # the removal is queued: wait until the router no longer lists it
    while ids and worker_url in list_workers(router_url, headers) and time.monotonic() < deadline:
        time.sleep(0.1)
    return bool(ids)
