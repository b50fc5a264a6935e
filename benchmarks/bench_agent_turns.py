"""Multi-turn rollouts through two engines behind the real sglang-router: does each turn reuse the KV of the turns
before it, and what does the rollout's own bookkeeping cost per turn?

    python benchmarks/bench_agent_turns.py [--sessions 16] [--turns 4] [--policies round_robin,cache_aware,manual]

Each session is one `slime.rollout.multi_turn.generate` conversation (a tiny Qwen3 built locally; every turn calls a
tool whose answer is ~40 tokens). For every turn after the first the engine reports `cached_tokens`; the hit rate
is cached / the tokens the session had already sent (its context before this turn's tool answer). Turns carry the
session id as `X-SMG-Routing-Key`; `manual` routes on it (sglang-router 0.3.2 has no `consistent_hashing`),
`cache_aware` on the prompt prefix, `round_robin` is the baseline that ignores both. Bookkeeping = the time of a
conversation minus the time spent inside its /generate requests, per turn. Prints a table and a JSON last line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slime.config.arguments import parse_args
from slime.engine.server.launch import launch_server
from slime.ray.router import RouterProcess, register_worker
from slime.rollout import multi_turn
from slime.utils.http_utils import run
from slime.utils.tiny_model import build_tiny_model
from slime.utils.tool_parsers import ParsedTurn, ToolCall
from slime.utils.types import Sample

TOOL_ANSWER = "the weather in the city is sunny with a light breeze and twenty one degrees " * 2


def weather(city: str) -> str:
    return TOOL_ANSWER


def always_calls(text, tools):
    return ParsedTurn(text, [ToolCall("weather", {"city": "x"}, text)])


# Turns end at a stop token (ids 3..40: about one token in ten), at most 24 tokens per turn (set per request).
SAMPLING = {"temperature": 1.0, "max_new_tokens": 400, "no_stop_trim": True, "stop_token_ids": list(range(3, 40))}


def rollout_args(model_dir: str, router, num_turns: int):
    """train.py's args for conversations that call `weather` every turn (slime.rollout.multi_turn)."""
    args = parse_args(["--hf-checkpoint", model_dir, "--rollout-batch-size", "1", "--num-rollout", "1",
                       "--max-turns", str(num_turns), "--tool-functions-path", f"{__name__}.weather",
                       "--tool-call-parser", f"{__name__}.always_calls", "--tool-timeout", "5",
                       "--max-tool-response-chars", "4096", "--rm-type", "random"])
    args.sglang_router_ip, args.sglang_router_port = router.host, router.port
    return args


def measure(model_dir: str, urls: list[str], policy: str, num_sessions: int, num_turns: int) -> dict:
    router = RouterProcess(policy=policy)
    try:
        for url in urls:
            register_worker(router.url, url)
        args = rollout_args(model_dir, router, num_turns)
        params = dict(SAMPLING)
        records, request_seconds = [], 0.0
        real_continuation = multi_turn.sample_continuation

        async def recording(args_, sample, sampling_params):
            nonlocal request_seconds
            seen = len(sample.tokens)
            before = sample.prefix_cache_info.cached_tokens
            started = time.perf_counter()
            text = await real_continuation(args_, sample, {**sampling_params, "max_new_tokens": 24})
            request_seconds += time.perf_counter() - started
            cached = sample.prefix_cache_info.cached_tokens - before
            records.append((sample.session_id, seen, cached))
            return text

        multi_turn.sample_continuation = recording
        try:
            async def conversation(index):
                sample = Sample(prompt=[{"role": "user", "content": f"What is the weather in city {index}?"}],
                                index=index, session_id=f"session-{index}")
                return await multi_turn.generate(args, sample, params)

            async def all_sessions():
                return await asyncio.gather(*(conversation(i) for i in range(num_sessions)))

            started = time.perf_counter()
            samples = run(all_sessions())
            total_seconds = time.perf_counter() - started
        finally:
            multi_turn.sample_continuation = real_continuation
    finally:
        router.shutdown()
    # Per session: the context it had sent by the end of each turn; a later turn can reuse all of it.
    sent_before: dict[str, int] = {}
    reuse_seen = reuse_cached = 0
    for session_id, seen, cached in records:
        if session_id in sent_before:
            reuse_seen += sent_before[session_id]
            reuse_cached += min(cached, sent_before[session_id])
        sent_before[session_id] = seen
    num_turns_done = sum(s.metadata["multi_turn"]["turns"] for s in samples)
    return {"policy": policy, "turns": num_turns_done,
            "prefix_hit_of_seen": reuse_cached / max(reuse_seen, 1),
            "seconds": total_seconds, "request_seconds_summed": request_seconds}


def bookkeeping_ms_per_turn(model_dir: str, url: str, num_turns: int) -> float:
    """One conversation at a time against one engine: (wall - time inside /generate) / turns."""
    router = RouterProcess(policy="round_robin")
    try:
        register_worker(router.url, url)
        args = rollout_args(model_dir, router, num_turns)
        params = dict(SAMPLING)
        inside = 0.0
        real = multi_turn.sample_continuation

        async def timed(args_, sample, sampling_params):
            nonlocal inside
            started = time.perf_counter()
            try:
                return await real(args_, sample, {**sampling_params, "max_new_tokens": 24})
            finally:
                inside += time.perf_counter() - started

        multi_turn.sample_continuation = timed
        try:
            per_turn = []
            for index in range(8):
                inside = 0.0
                sample = Sample(prompt=[{"role": "user", "content": f"weather {index}"}], index=index)
                started = time.perf_counter()
                sample = run(multi_turn.generate(args, sample, params))
                wall = time.perf_counter() - started
                per_turn.append((wall - inside) / sample.metadata["multi_turn"]["turns"] * 1e3)
        finally:
            multi_turn.sample_continuation = real
        return statistics.median(per_turn[1:])  # the first pays the tokenizer's and the tool loader's caches
    finally:
        router.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--policies", default="round_robin,cache_aware,manual")
    opts = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench_agent_turns_"))
    model_dir = str(build_tiny_model(root / "tiny", arch="qwen3"))
    servers = [launch_server(model_dir, extra_args=["--kvcache-block-size", "16"], log_path=root / f"engine{i}.log",
                             env={"OMP_NUM_THREADS": "1"}) for i in range(2)]
    try:
        results = [measure(model_dir, [s.url for s in servers], policy, opts.sessions, opts.turns)
                   for policy in opts.policies.split(",")]
        overhead = bookkeeping_ms_per_turn(model_dir, servers[0].url, opts.turns)
    finally:
        for server in servers:
            server.stop()
    print(f"{'policy':<12} {'turns':>6} {'prefix hit of seen tokens':>26} {'seconds':>8}")
    for r in results:
        print(f"{r['policy']:<12} {r['turns']:>6} {r['prefix_hit_of_seen']:>26.3f} {r['seconds']:>8.2f}")
    print(f"rollout bookkeeping per turn (excluding /generate): {overhead:.2f} ms")
    print(json.dumps({"results": results, "bookkeeping_ms_per_turn": overhead}))


if __name__ == "__main__":
    main()
