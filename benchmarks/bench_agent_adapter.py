"""What the OpenAI agent adapter adds to a turn: an agent written against the official `openai` client talks to
`slime.agent.adapters.OpenAIAdapter`, which renders the chat template, calls the engine through the real
sglang-router and records the turn for the trajectory manager; the baseline is the same `/generate` request (same
prompt ids, same sampling) sent straight to the router in the same run.

    python benchmarks/bench_agent_adapter.py --shape qwen3-0.6b --device cuda    # one H200
    python benchmarks/bench_agent_adapter.py                                      # tiny model, CPU

Each session has `--turns` turns of `--max-tokens` tokens (ignore_eos, greedy); every turn is timed both ways, in
alternating order so that neither side always finds the other's prompt in the prefix cache. Reports the median
per-turn wall time of each path, their difference (the adapter's cost: client, HTTP hop, template, parse, record)
and the adapter's in-process time with the engine call excluded. Prints a table and a JSON last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_checkpoints import QWEN3_06B_SHAPE, TINY_SHAPE, build_checkpoint

SHAPES = {"qwen3-0.6b": QWEN3_06B_SHAPE, "tiny": TINY_SHAPE}


def build_model(shape: str, device: str, root: Path) -> str:
    import torch
    from transformers import AutoTokenizer

    from slime.utils.tiny_model import CHAT_TEMPLATE

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    path = build_checkpoint(root / shape, SHAPES[shape], dtype, device, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return str(path)


async def run_sessions(model_dir: str, router_url: str, opts) -> dict:
    from aiohttp import web
    from openai import AsyncOpenAI
    from transformers import AutoTokenizer

    from slime.agent.adapters import OpenAIAdapter
    from slime.agent.adapters import common as adapter_common
    from slime.utils.http_utils import request_json
    from slime.utils.misc import find_free_port

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    adapter = OpenAIAdapter(tokenizer=tokenizer, sglang_url=router_url, max_turns=opts.turns + 1)
    engine_seconds = 0.0
    real_request = adapter_common.request_json

    async def timed_request(*args, **kwargs):
        nonlocal engine_seconds
        started = time.perf_counter()
        try:
            return await real_request(*args, **kwargs)
        finally:
            engine_seconds += time.perf_counter() - started

    adapter_common.request_json = timed_request
    runner = web.AppRunner(adapter.app)
    await runner.setup()
    port = find_free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    params = {"temperature": 0.0, "max_new_tokens": opts.max_tokens, "ignore_eos": True}
    via_adapter, direct, in_process = [], [], []
    try:
        for session in range(opts.sessions):
            session_id = f"bench-{session}"
            adapter.open_session(session_id, sampling_defaults={"ignore_eos": True})
            client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=session_id, max_retries=0)
            messages = [{"role": "user", "content": " ".join(f"t{10 + (session * 7 + i) % 400}"
                                                             for i in range(opts.prompt_words))}]
            for turn in range(opts.turns):
                prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                           return_dict=False)
                order = ("direct", "adapter") if (session + turn) % 2 else ("adapter", "direct")
                for path in order:
                    started = time.perf_counter()
                    if path == "adapter":
                        engine_seconds = 0.0
                        reply = await client.chat.completions.create(
                            model="slime", messages=messages, max_tokens=opts.max_tokens, temperature=0.0)
                        elapsed = time.perf_counter() - started
                        via_adapter.append(elapsed)
                        in_process.append(elapsed - engine_seconds)
                    else:
                        await request_json("POST", f"{router_url}/generate", {
                            "input_ids": list(prompt_ids), "sampling_params": params, "return_logprob": True})
                        direct.append(time.perf_counter() - started)
                messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                             {"role": "user", "content": f"t{20 + turn} t{21 + turn} t{22 + turn}"}]
            await client.close()
            samples = await adapter.finish_session(session_id)
            assert samples and sum(sum(s.loss_mask) for s in samples) == opts.turns * opts.max_tokens
    finally:
        adapter_common.request_json = real_request
        await runner.cleanup()
    skip = opts.turns  # the first session warms every cache
    adapter_ms = statistics.median(via_adapter[skip:]) * 1e3
    direct_ms = statistics.median(direct[skip:]) * 1e3
    return {"adapter_turn_ms": adapter_ms, "direct_turn_ms": direct_ms, "overhead_ms": adapter_ms - direct_ms,
            "adapter_in_process_ms": statistics.median(in_process[skip:]) * 1e3, "turns_timed": len(via_adapter) - skip}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--sessions", type=int, default=6)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-words", type=int, default=200)
    opts = parser.parse_args()

    from slime.engine.server.launch import launch_server
    from slime.ray.router import RouterProcess, register_worker
    from slime.utils.http_utils import run

    root = Path(tempfile.mkdtemp(prefix="bench_agent_adapter_"))
    model_dir = build_model(opts.shape, opts.device, root)
    server = launch_server(model_dir, extra_args=["--device", opts.device], log_path=root / "engine.log",
                           startup_timeout_s=600)
    router = RouterProcess(policy="manual")
    try:
        register_worker(router.url, server.url)
        result = run(run_sessions(model_dir, router.url, opts))
    finally:
        router.shutdown()
        server.stop()
    result.update(shape=opts.shape, device=opts.device, max_tokens=opts.max_tokens)
    print(f"{'path':<34} {'median ms / turn':>16}")
    print(f"{'openai client -> adapter -> router':<34} {result['adapter_turn_ms']:>16.2f}")
    print(f"{'/generate -> router (baseline)':<34} {result['direct_turn_ms']:>16.2f}")
    print(f"{'adapter overhead':<34} {result['overhead_ms']:>16.2f}")
    print(f"{'adapter in-process (no engine)':<34} {result['adapter_in_process_ms']:>16.2f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
