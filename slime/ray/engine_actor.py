"""One rollout engine as a Ray actor: it owns an engine HTTP server child process on its device.

The built-in engine (`python -m slime.engine.server`) is the default; `--rollout-backend sglang` launches a real
SGLang server with the same HTTP API instead. The actor is scheduled on a placement-group bundle, so the child
inherits that bundle's device (Ray sets CUDA_VISIBLE_DEVICES); everything else talks to the server over HTTP.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from slime.utils.misc import find_free_port


class EngineStartError(RuntimeError):
    pass


def engine_server_command(args, port: int) -> list[str]:
    if args.rollout_backend == "sglang":
        if importlib.util.find_spec("sglang") is None:
            raise EngineStartError("--rollout-backend sglang: the sglang package is not installed "
                                   "(pip install sglang), or use the built-in engine (--rollout-backend slime)")
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", args.hf_checkpoint,
               "--host", "127.0.0.1", "--port", str(port), "--tp-size", str(args.rollout_num_gpus_per_engine),
               "--enable-memory-saver", "--random-seed", str(args.seed)]
        if "gpu_memory_utilization" in args.engine_config:
            cmd += ["--mem-fraction-static", str(args.engine_config["gpu_memory_utilization"])]
        return cmd
    cmd = [sys.executable, "-m", "slime.engine.server", "--model-path", args.hf_checkpoint,
           "--host", "127.0.0.1", "--port", str(port), "--device", args.device, "--seed", str(args.seed)]
    for field, value in args.engine_config.items():
        flag = "--" + field.replace("_", "-")
        if isinstance(value, bool):
            cmd += [flag] if value else []
        else:
            cmd += [flag, str(value)]
    return cmd


class EngineActor:
    def __init__(self, args, rank: int):
        self.args = args
        self.rank = rank
        self.process = None
        self.url = None

    def start(self, timeout: float = 600.0) -> str:
        port = find_free_port()
        self.url = f"http://127.0.0.1:{port}"
        log_path = Path(self.args.output_dir) / f"engine_{self.rank}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        if self.args.device == "cpu":
            # Sync training leaves the cores to the engine while it generates.
            env["OMP_NUM_THREADS"] = str(os.cpu_count() or 1)
        self._log = open(log_path, "ab")
        self.process = subprocess.Popen(engine_server_command(self.args, port), stdout=self._log,
                                        stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = log_path.read_text(errors="replace")[-3000:]
                raise EngineStartError(f"engine {self.rank} exited with code {self.process.returncode}; "
                                       f"log {log_path}:\n{tail}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0, trust_env=False).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise EngineStartError(f"engine {self.rank} at {self.url} not healthy after {timeout:.0f} s; see {log_path}")

    def is_alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def shutdown(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
