"""The default rollout's own per-sample host work, on recorded-shape payloads, with no engine and no network: the
client making a group's prompt ids (through the chat template and the tokenizer of the tiny test model, once per
group against once per sample as before), encoding the grouped /generate request (SGLang's `sampling_params.n`), the server decoding it, rendering each
finished RequestOutput (`http_protocol.generate_response`), encoding the response, the client decoding it and
building the Samples (`sglang_rollout._append_output`). Each JSON step is timed both ways in the same run: the
stdlib path (FastAPI's `jsonable_encoder` + `json.dumps` for a returned dict, `json` in aiohttp and the server)
and orjson (what the server and the rollout client use), with the ratio.

    python benchmarks/bench_rollout_io.py                      # 8 samples x 256 prompt x 256 response tokens

Prints a table (microseconds per sample, median of --repeats) and a JSON last line. Measures no HTTP round trip,
router hop or engine time (bench_loop.py measures the rollout phase end to end on a GPU).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import orjson
from fastapi.encoders import jsonable_encoder

from slime.engine.request_output import RequestOutput
from slime.engine.server.protocol import generate_response
from slime.rollout.dataset import load_tokenizer, prompt_token_ids
from slime.rollout.generate_request import _append_output, group_prompt_ids
from slime.utils.tiny_model import build_tiny_model
from slime.utils.types import Sample

VOCAB_SIZE = 151_936  # Qwen3's: token ids of up to six digits, as in the loop's requests


def recorded_outputs(num_samples: int, prompt_len: int, response_len: int, seed: int):
    """The prompt ids and `num_samples` finished RequestOutputs of one group, shaped like an engine's."""
    rng = random.Random(seed)
    prompt = [rng.randrange(VOCAB_SIZE) for _ in range(prompt_len)]
    outputs = []
    for index in range(num_samples):
        response = [rng.randrange(VOCAB_SIZE) for _ in range(response_len)]
        log_probs = [-rng.expovariate(1.0) for _ in range(response_len)]
        text = " ".join(f"w{token % 5000}" for token in response)
        outputs.append(RequestOutput(f"rid-{index}", prompt + response, prompt_len, log_probs, text=text,
                                     finished=True, finish_reason={"type": "length", "length": response_len},
                                     num_cached_tokens=prompt_len - 16 if index else 0, weight_version="3"))
    return prompt, outputs


def stages(num_samples: int, prompt_len: int, response_len: int, seed: int, model_dir: str) -> dict:
    """{stage: {path: zero-argument callable}}, each doing one group's worth of that stage; `model_dir` holds the
    tokenizer (with a chat template) that makes the prompt ids."""
    prompt, outputs = recorded_outputs(num_samples, prompt_len, response_len, seed)
    tokenizer = load_tokenizer(model_dir)
    question = " ".join(f"w{token % 5000}" for token in prompt[: prompt_len // 2])
    group = [Sample(prompt=[{"role": "user", "content": question}], index=i) for i in range(num_samples)]
    group_args = SimpleNamespace(hf_checkpoint=model_dir, custom_generate_function_path=None, max_turns=1,
                                 rollout_sample_hook_path=None, use_rollout_routing_replay=False)
    sampling_params = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": response_len, "skip_special_tokens": False,
                       "no_stop_trim": True, "n": num_samples}
    request = {"input_ids": prompt, "sampling_params": sampling_params, "return_logprob": True}
    request_bytes = json.dumps(request).encode()
    rendered = [generate_response(output, True) for output in outputs]
    response_bytes = orjson.dumps(rendered)
    args = SimpleNamespace(sglang_router_ip="127.0.0.1", sglang_router_port=0, use_rollout_routing_replay=False)
    decoded = orjson.loads(response_bytes)

    def build_samples():
        for output in decoded:
            sample = Sample(prompt="p", tokens=list(prompt))
            _append_output(args, sample, output, routed_experts_start_len=0)

    return {
        "client: group prompt ids": {"per sample": lambda: [prompt_token_ids(tokenizer, s) for s in group],
                                     "per group": lambda: group_prompt_ids(group_args, group)},
        "client: encode request": {"stdlib": lambda: json.dumps(request).encode(), "orjson": lambda: orjson.dumps(request)},
        "server: decode request": {"stdlib": lambda: json.loads(request_bytes), "orjson": lambda: orjson.loads(request_bytes)},
        "server: render outputs": {"same": lambda: [generate_response(output, True) for output in outputs]},
        "server: encode response": {
            "stdlib": lambda: json.dumps(jsonable_encoder(rendered), ensure_ascii=False, allow_nan=False,
                                         separators=(",", ":")).encode(),
            "orjson": lambda: orjson.dumps(rendered),
        },
        "client: decode response": {"stdlib": lambda: json.loads(response_bytes), "orjson": lambda: orjson.loads(response_bytes)},
        "client: build Samples": {"same": build_samples},
    }


def median_us_per_sample(fn, num_samples: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) / num_samples * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-samples", type=int, default=8, help="samples per group (sampling_params.n)")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--response-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_rollout_io_") as tmp:
        model_dir = str(build_tiny_model(Path(tmp) / "tiny", arch="qwen3"))
        for stage, paths in stages(opts.num_samples, opts.prompt_len, opts.response_len, opts.seed, model_dir).items():
            # Alternate the paths, so that load from other processes falls on both alike.
            timings = {path: [] for path in paths}
            for _ in range(5):
                for path, fn in paths.items():
                    timings[path].append(median_us_per_sample(fn, opts.num_samples, max(1, opts.repeats // 5)))
            results[stage] = {path: round(statistics.median(values), 2) for path, values in timings.items()}
    print(f"per-sample host work, {opts.num_samples} samples x {opts.prompt_len} prompt x {opts.response_len} "
          "response tokens (microseconds per sample, median)")
    print(f"{'stage':28s} {'before':>10s} {'after':>10s} {'ratio':>7s}   (before / after: stdlib / orjson, per sample / "
          "per group, or the same code)")
    total_before = total_after = 0.0
    for stage, timing in results.items():
        before, after = list(timing.values())[0], list(timing.values())[-1]
        total_before, total_after = total_before + before, total_after + after
        ratio = f"{before / after:.1f}x" if len(timing) > 1 else ""
        print(f"{stage:28s} {before:10.1f} {after:10.1f} {ratio:>7s}")
    print(f"{'total':28s} {total_before:10.1f} {total_after:10.1f} {total_before / total_after:6.1f}x")
    print(json.dumps({"benchmark": "rollout_io", "num_samples": opts.num_samples, "prompt_len": opts.prompt_len,
                      "response_len": opts.response_len, "us_per_sample": results,
                      "total_us_per_sample_before": round(total_before, 1),
                      "total_us_per_sample_after": round(total_after, 1),
                      "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}))


if __name__ == "__main__":
    main()
