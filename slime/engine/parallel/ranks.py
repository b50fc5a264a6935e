"""Rank 0's handle on the other ranks of a sharded engine: it spawns them, sends each step's plan and each call,
collects the calls' replies, and takes the whole engine down when one rank dies.

Rank r > 0 is a child process (`worker.py`) on device cuda:r of the server's visible devices (or the CPU), joined to
rank 0 by a pipe (plans and calls) and by the engine's own process group (the model's collectives), whose address is
a free port of 127.0.0.1 found at start, so several engines on one host never collide. Everything is sent from one
thread at a time (a lock), so the ranks see steps and calls in the order rank 0 ran them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import threading
from dataclasses import asdict
from multiprocessing.connection import wait

import torch.multiprocessing as mp

from slime.engine.config import Config
from slime.engine.parallel.rank_weights import RankError
from slime.engine.parallel.step_plan import CALL, STOP, encode_control
from slime.engine.parallel.worker import RankSpec, init_distributed, worker_main
from slime.utils.misc import find_free_port

logger = logging.getLogger(__name__)


class EngineRanks:
    def __init__(self, config: Config, eos_token_ids: set[int]):
        self.size = config.tp_size
        init_method = f"tcp://127.0.0.1:{find_free_port()}"
        threads = max(1, (os.cpu_count() or 1) // self.size)
        spec = RankSpec(asdict(config), sorted(eos_token_ids), init_method, threads, os.getpid())
        context = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for rank in range(1, self.size):
            parent_end, child_end = context.Pipe(duplex=True)
            proc = context.Process(target=worker_main, args=(rank, spec, child_end), name=f"engine-rank-{rank}",
                                   daemon=True)
            proc.start()
            child_end.close()
            self.conns.append(parent_end)
            self.procs.append(proc)
        self.lock = threading.RLock()
        self.closing = False
        self.last_results: list = []
        threading.Thread(target=self._watch, name="engine-rank-watch", daemon=True).start()
        self.parallel = init_distributed(0, config, init_method)

    def wait_ready(self) -> list[dict]:
        """Each other rank's start-up report (rank_info), once its model and KV cache are built."""
        reports = []
        for rank, conn in enumerate(self.conns, start=1):
            status, info = conn.recv()
            if status != "ready":
                raise RankError(f"engine rank {rank} did not start: {info}")
            reports.append({"rank": rank, **info})
        return reports

    def _watch(self) -> None:
        """The engine is the unit of failure: a rank that exits takes the server (rank 0) with it, at once, instead
        of leaving it waiting in a collective; the others then die with their parent."""
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self.procs, start=1)}
        ready = wait(list(sentinels))
        if self.closing:
            return
        rank = sentinels[ready[0]]
        self.stop_engine(f"engine rank {rank} (pid {self.procs[rank - 1].pid}) exited with code "
                         f"{self.procs[rank - 1].exitcode}")

    @staticmethod
    def stop_engine(reason: str) -> None:
        """End the server process now (its ranks die with it: PR_SET_PDEATHSIG), so the health check fails and
        --use-fault-tolerance restarts the engine with all its ranks. Used when a rank dies and when a step fails
        (a rank hung past dist_timeout_s, a broken collective): the ranks may then be out of step."""
        logger.critical("%s: the engine stops with every rank", reason)
        logging.shutdown()
        os._exit(70)

    def send_step(self, message: bytes) -> None:
        with self.lock:
            for conn in self.conns:
                conn.send_bytes(message)

    @contextlib.contextmanager
    def calling(self, target: str, *args, **kwargs):
        """Start `target` ("runner.<method>" or "weights.<method>") on every other rank, run the block (rank 0's own
        part, at the same time), then wait for their replies (`last_results`, in rank order). A rank's error is
        raised as RankError naming the rank, after every reply is in (the pipes stay in step)."""
        if "." not in target:
            target = f"runner.{target}"
        message = encode_control(CALL) + pickle.dumps((target, args, kwargs))
        with self.lock:
            for conn in self.conns:
                conn.send_bytes(message)
            try:
                yield
            finally:
                replies = [conn.recv() for conn in self.conns]
            errors = [f"engine rank {rank}: {value}" for rank, (status, value) in enumerate(replies, start=1)
                      if status == "error"]
            self.last_results = [value for _status, value in replies]
            if errors:
                raise RankError(f"{target} failed on " + "; ".join(errors))

    def call(self, target: str, *args, **kwargs) -> list:
        with self.calling(target, *args, **kwargs):
            pass
        return self.last_results

    def close(self) -> None:
        self.closing = True
        with contextlib.suppress(OSError):
            self.send_step(encode_control(STOP))
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
