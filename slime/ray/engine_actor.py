"""One rollout engine as a Ray actor: it owns an engine HTTP server child process on its devices.

The built-in engine (`python -m slime.engine.server`) is the default; `--rollout-backend sglang` launches a real
SGLang server with the same HTTP API instead. An engine spans `--rollout-num-gpus-per-engine` N devices: the actor
sits on the first of its N placement-group bundles and starts the server with CUDA_VISIBLE_DEVICES naming all N
(`device_ids`, from slime/ray/placement_group.py); the server (rank 0) starts its ranks 1..N-1 itself, one per
visible device (N CPU processes on the CPU). The engine is the unit: `kill` and `shutdown` end the server and every
process under it, and `start` brings all its ranks back. Everything else talks to the server over HTTP.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from slime.config.flags_sglang import sglang_server_flags
from slime.engine.server.config import write_config_file
from slime.engine.server.launch import launch_process
from slime.utils.misc import find_free_port


class EngineStartError(RuntimeError):
    pass


def engine_server_command(args, port: int, config_path: Path) -> list[str]:
    """The command line of engine `port`'s server. The built-in engine gets its settings as a JSON file at
    `config_path` (typed values, owner-only: it holds the keys), never as re-serialised flags."""
    if args.rollout_backend == "sglang":
        if importlib.util.find_spec("sglang") is None:
            raise EngineStartError("--rollout-backend sglang: the sglang package is not installed "
                                   "(pip install sglang), or use the built-in engine (--rollout-backend slime)")
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", args.hf_checkpoint,
               "--host", "127.0.0.1", "--port", str(port), "--tp-size", str(args.rollout_num_gpus_per_engine),
               "--enable-memory-saver", "--random-seed", str(args.seed)]
        cmd += sglang_server_flags(args)  # every --sglang-* server flag the run gives, as SGLang's own
        if args.use_rollout_routing_replay:
            cmd += ["--enable-return-routed-experts"]
        # SGLang reads its keys from flags only (visible to local users in `ps`); the docs say so.
        for flag, key in (("--api-key", args.sglang_api_key), ("--admin-api-key", args.sglang_admin_api_key)):
            cmd += [flag, key] if key else []
        return cmd
    engine = {"device": args.device, "seed": args.seed, **args.engine_config,
              "tp_size": args.rollout_num_gpus_per_engine}
    server = {name: value for name, value in (("api_key", args.sglang_api_key),
                                              ("admin_api_key", args.sglang_admin_api_key)) if value}
    if args.update_weight_transport == "disk":  # the server may then read (and pull into) these folders too
        folders = (str(Path(args.hf_checkpoint).resolve().parent), args.update_weight_disk_dir,
                   args.update_weight_local_checkpoint_dir)
        server["weights_dir_allowlist"] = [folder for folder in folders if folder]
    write_config_file(config_path, args.hf_checkpoint, engine, server)
    # Info level: the engine's log file (engine_<rank>.log) then records its start-up and CUDA-graph capture times.
    return [sys.executable, "-m", "slime.engine.server", "--config-file", str(config_path),
            "--host", "127.0.0.1", "--port", str(port), "--log-level", "info"]


def engine_env(args, device_ids: list[str] | None) -> dict[str, str]:
    """The server's environment beside the actor's: its N devices, and on the CPU the cores (sync training leaves
    them to the engine while it generates; its N rank processes share them)."""
    env = {"CUDA_VISIBLE_DEVICES": ",".join(device_ids)} if device_ids else {}
    if args.device == "cpu":
        num_threads = max(1, (os.cpu_count() or 1) // args.rollout_num_gpus_per_engine)
        env["OMP_NUM_THREADS"] = str(num_threads)
    return env


class EngineActor:
    def __init__(self, args, rank: int, device_ids: list[str] | None = None):
        """`device_ids`: the engine's N devices as CUDA_VISIBLE_DEVICES entries (None on the CPU, or to keep the
        device Ray gave the actor)."""
        self.args = args
        self.rank = rank
        self.device_ids = device_ids
        self.server = None
        self.num_starts = 0

    def start(self, timeout: float = 600.0) -> str:
        """Start the server on a fresh port and return its URL. A restart (after `kill`) logs to
        engine_<rank>.restart_<n>.log, so the log of the process that failed stays for its error message."""
        port = find_free_port()
        suffix = f".restart_{self.num_starts}" if self.num_starts else ""
        self.num_starts += 1
        log_path = Path(self.args.output_dir) / f"engine_{self.rank}{suffix}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            command = engine_server_command(self.args, port, log_path.with_name(f"engine_{self.rank}.json"))
            self.server = launch_process(command, f"http://127.0.0.1:{port}", log_path,
                                         engine_env(self.args, self.device_ids), startup_timeout_s=timeout)
        except RuntimeError as exc:
            raise EngineStartError(f"engine {self.rank} did not start (log {log_path}): {exc}") from None
        return self.server.url

    def exit_status(self) -> tuple[int | None, str]:
        """(the server's exit code, negative for the signal that ended it, or None while it runs; its log file)."""
        return self.server.process.poll(), str(self.server.log_path)

    def kill(self) -> None:
        """SIGKILL the server (a hung one, e.g. stopped by SIGSTOP, ignores SIGTERM) and every process under it (its
        ranks), and reap them: a restart then finds the engine's devices free."""
        if self.server is not None and self.server.process.poll() is None:
            ranks = _descendants(self.server.process.pid)
            self.server.process.kill()
            self.server.process.wait()
            _kill_all(ranks)

    def shutdown(self) -> None:
        if self.server is not None:
            ranks = _descendants(self.server.process.pid) if self.server.process.poll() is None else []
            self.server.stop()
            _kill_all(ranks)  # the server ends its ranks itself; any left after it stopped go now
            # Finalise the Popen now: left for actor teardown, its __del__ can be what Ray's SIGTERM interrupts,
            # which printed an "Exception ignored ... SystemExit" traceback at the end of every run.
            self.server = None


def _descendants(pid: int) -> list:
    """The processes under `pid` (an engine server's ranks), found before it ends (then they are orphans)."""
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _kill_all(processes: list) -> None:
    """SIGKILL those of `processes` still alive (the same processes: psutil checks their start time) and wait."""
    import psutil

    alive = [process for process in processes if process.is_running()]
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=10)
