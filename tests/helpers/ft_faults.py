"""Fault injection for the fault-tolerance tests: `--custom-generate-function-path tests.helpers.ft_faults.generate`.

It wraps the default generate function and, at the call numbers listed in `{output_dir}/faults.json`, does to the
run's real processes what a failure would: SIGKILL or SIGSTOP engine servers, SIGKILL the sglang-router, or probe
every engine with one fixed sequence (its log-probs go to `{output_dir}/probe_<call>.json`). Calls are counted in
the RolloutManager's process, in the order the rollout starts them.

    [{"at_call": 11, "action": "sigkill", "engines": [0], "pause_s": 1.0}, {"at_call": 20, "action": "probe"}]

"sigkill" first stops the engine for `pause_s` seconds, so that requests the router sends it meanwhile are in
flight on it when it dies (a tiny model answers too fast to catch one otherwise). "sigkill_rank" SIGKILLs the rank
processes 1..N-1 of an engine of N ranks (its server's spawned children), not the server: the engine must go down
with them.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
from pathlib import Path

import httpx
import psutil

from slime.rollout.sglang_rollout import generate as default_generate

PROBE_TOKENS = [5, 17, 33, 8, 21, 2, 40, 11]
_calls = itertools.count()


def _processes(needle: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if needle in " ".join(process.info["cmdline"] or []):
            found.append(process)
    return found


def engine_processes(output_dir: str, rank: int) -> list[psutil.Process]:
    """The running server process(es) of engine `rank` of the run in `output_dir` (its config file names it)."""
    config = str(Path(output_dir) / f"engine_{rank}.json")
    return [p for p in _processes(config) if "slime.engine.server" in " ".join(p.cmdline())]


def router_processes(port: int) -> list[psutil.Process]:
    """The process listening on the router's port (the router renames its process, so not by command line)."""
    return [psutil.Process(c.pid) for c in psutil.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid]


def probe_engines(args) -> dict:
    """Each engine's log-probs of PROBE_TOKENS' continuation (seeded sampling, same request everywhere)."""
    workers = httpx.get(f"http://{args.sglang_router_ip}:{args.sglang_router_port}/workers", trust_env=False).json()
    answers = {}
    for worker in workers["workers"]:
        payload = {"input_ids": PROBE_TOKENS, "return_logprob": True,
                   "sampling_params": {"max_new_tokens": 4, "temperature": 1.0, "sampling_seed": 7,
                                       "ignore_eos": True}}
        meta = httpx.post(f"{worker['url']}/generate", json=payload, timeout=60, trust_env=False).json()["meta_info"]
        answers[worker["url"]] = {"token_ids": [item[1] for item in meta["output_token_logprobs"]],
                                  "log_probs": [item[0] for item in meta["output_token_logprobs"]],
                                  "weight_version": meta.get("weight_version")}
    return answers


async def _inject(args, fault: dict, call: int) -> None:
    action = fault["action"]
    if action == "probe":
        answers = await asyncio.to_thread(probe_engines, args)
        (Path(args.output_dir) / f"probe_{call}.json").write_text(json.dumps(answers))
        return
    if action == "kill_router":
        processes = router_processes(args.sglang_router_port)
        assert processes, f"no process listens on the router's port {args.sglang_router_port}"
        for process in processes:
            process.send_signal(signal.SIGKILL)
        return
    processes = [p for rank in fault["engines"] for p in engine_processes(args.output_dir, rank)]
    assert processes, f"no engine server of ranks {fault['engines']} found for {args.output_dir}"
    if action == "sigkill_rank":
        ranks = [child for server in processes for child in server.children()
                 if "spawn_main" in " ".join(child.cmdline())]
        assert ranks, f"engines {fault['engines']} have no rank processes (--rollout-num-gpus-per-engine 1?)"
        for process in ranks:
            process.send_signal(signal.SIGKILL)
        pids = {"servers": [p.pid for p in processes], "ranks": [p.pid for p in ranks]}
        (Path(args.output_dir) / f"fault_{call}.done").write_text(json.dumps(pids))
        return
    for process in processes:
        process.send_signal(signal.SIGSTOP)
    if action == "sigkill":
        await asyncio.sleep(fault.get("pause_s", 1.0))
        for process in processes:
            process.send_signal(signal.SIGKILL)
    (Path(args.output_dir) / f"fault_{call}.done").write_text(" ".join(str(p.pid) for p in processes))


async def generate(args, sample, sampling_params):
    call = next(_calls)
    faults_path = Path(args.output_dir) / "faults.json"
    for fault in json.loads(faults_path.read_text()) if faults_path.is_file() else []:
        if fault["at_call"] == call:
            await _inject(args, fault, call)
    return await default_generate(args, sample, sampling_params)


__all__ = ["generate", "engine_processes", "router_processes", "probe_engines", "kill_rank_1_at_rollout_1",
           "kill_engine_0_at_rollout_1"]


def kill_rank_1_at_rollout_1(args, rollout_id, step_id, model, optimizer, scheduler):
    """A `--custom-before-train-step-hook-path` that SIGKILLs train rank 1's own process at rollout 1."""
    import torch.distributed as dist

    if rollout_id == 1 and dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)


def kill_engine_0_at_rollout_1(args, rollout_id, step_id, model, optimizer, scheduler):
    """A `--custom-before-train-step-hook-path` that SIGKILLs engine 0's server while the trainer trains on
    rollout 1 (in a colocated run the engines' memory is released then)."""
    import torch.distributed as dist

    if rollout_id == 1 and step_id == 0 and dist.get_rank() == 0:
        for process in engine_processes(args.output_dir, 0):
            process.send_signal(signal.SIGKILL)
