"""Ranks 1..N-1 of a sharded engine: a child process of the engine server (rank 0) that builds its shard of the model
and KV cache, then follows rank 0's plan until told to stop.

The loop reads one message at a time from its pipe to rank 0 (`step_plan.py`): a step to run, or a call (a
ModelRunner `@every_rank` method, or a `RankWeights` method for weight updates) whose result or error goes back on
the pipe. The rank dies with rank 0: the kernel sends it SIGKILL when its parent exits (PR_SET_PDEATHSIG), and a
closed pipe ends the loop; a collective that waits longer than `dist_timeout_s` raises, which ends the process too.
"""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from slime.engine.config import Config
from slime.engine.dtypes import resolve_device
from slime.engine.model_runner import ModelRunner
from slime.engine.models import load_model_config
from slime.engine.parallel.rank_weights import RankWeights
from slime.engine.parallel.state import ParallelState
from slime.engine.parallel.step_plan import CALL, HEADER_LEN, STOP, decode

logger = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1


@dataclass
class RankSpec:
    """What a rank process needs, pickled once when it is spawned."""

    config: dict
    eos_token_ids: list[int]
    init_method: str
    num_threads: int
    parent_pid: int


def init_distributed(rank: int, config: Config, init_method: str) -> ParallelState:
    """Join the engine's own process group (NCCL on CUDA, gloo on the CPU) and return this rank's ParallelState."""
    device = resolve_device(config.device)
    if device.type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init_method,
                            world_size=config.tp_size, rank=rank, timeout=timedelta(seconds=config.dist_timeout_s))
    return ParallelState(rank, config.tp_size, config.ep_size, dist.group.WORLD)


def rank_info(runner: ModelRunner) -> dict:
    """What rank 0 logs about each rank at start-up."""
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    return {"weight_bytes": weight_bytes, "kv_blocks": runner.num_kvcache_blocks,
            "kv_bytes_per_block": runner.bytes_per_block}


def _die_with_parent(parent_pid: int) -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: the closed pipe still ends the loop
        pass
    if os.getppid() != parent_pid:  # the parent died before the prctl took effect
        os._exit(1)


def worker_main(rank: int, spec: RankSpec, conn) -> None:
    _die_with_parent(spec.parent_pid)
    logging.basicConfig(level=logging.INFO, format=f"[engine rank {rank}] %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(spec.num_threads)
    try:
        config = Config(**spec.config)
        parallel = init_distributed(rank, config, spec.init_method)
        runner = ModelRunner(config, load_model_config(config.model), set(spec.eos_token_ids), parallel)
        weights = RankWeights(runner, rank)
        conn.send(("ready", rank_info(runner)))
        _follow(conn, runner, weights)
    except (EOFError, BrokenPipeError):
        os._exit(0)  # rank 0 is gone
    except BaseException:  # noqa: BLE001 - anything else ends this rank and, through its exit, the engine
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)


def _follow(conn, runner: ModelRunner, weights: RankWeights) -> None:
    targets = {"runner": runner, "weights": weights}
    while True:
        message = conn.recv_bytes()
        op, flags, payload = decode(message)
        if op == STOP:
            return
        if op != CALL:
            runner.follow_step((op, flags, payload))
            continue
        target_name, args, kwargs = pickle.loads(message[8 * HEADER_LEN:])
        owner, _, name = target_name.partition(".")
        try:
            conn.send(("ok", getattr(targets[owner], name)(*args, **kwargs)))
        except Exception as error:
            logger.exception("%s failed", target_name)
            conn.send(("error", f"{type(error).__name__}: {error}"))
