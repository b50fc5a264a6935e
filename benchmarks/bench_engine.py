"""Output-token throughput and memory-bandwidth utilisation of slime's built-in engine (Python API, no HTTP) on the
engine-speed workloads, with Hugging Face transformers `generate` measured in the same process where it is cheap
enough. Also: engine start-up time, a full weight update from tensors already on the device, release / resume of
the engine's memory, and (`--workload host`) the engine's host-side time per decode step. Prints a summary card and
a JSON last line.

    python benchmarks/bench_engine.py                                   # CPU: tiny variant of W1
    python benchmarks/bench_engine.py --workload all                    # CPU: tiny variants of W1-W4
    python benchmarks/bench_engine.py --preset qwen3-0.6b               # CUDA bf16: W1 (+ HF, update, release)
    python benchmarks/bench_engine.py --preset qwen3-0.6b --workload all
    python benchmarks/bench_engine.py --workload host                   # host ms per step, device work faked
    python benchmarks/bench_engine.py --preset quickstart               # CPU: W1 on the quickstart's own model

Workloads (`--preset qwen3-0.6b` sizes; `--preset tiny` runs small variants of each on the CPU):
    w1  Qwen3-0.6B shape, 256 prompts x 256 tokens, 256 out, temperature 1, EOS ignored; vs HF generate.
    w2  nano-vllm's benchmark: 256 sequences, prompt and output lengths uniform in [100, 1024] (Python `random`,
        seed 0, token ids in [0, 10000]), temperature 0.6, EOS ignored. HF is not run by default (about 227 s);
        a reference ratio against the 635 tok/s transformers measured on the same H200 in another session is
        printed, labelled as such. `--hf-workloads w1,w2` measures it in this run instead.
    w3  GRPO shape: 64 prompts x 8 samples sharing the prompt, prompts of 512 tokens, up to 1024 out (EOS
        honoured), temperature 1; also the prefix-cache hit rate (cached prompt tokens / prompt tokens; ideal 7/8,
        at most 7/8 * block-aligned prefix, since a prompt's last partial block and last token are recomputed).
    w4  W1 on the Qwen3-8B shape, engine only.
    w5  SmolLM-135M's shape (a Llama, 134.5M parameters), 512 prompts x 256 tokens, 256 out, T=1, EOS ignored: the
        small-model, large-batch case where the host's work per step is most of a step; vs HF generate.
    host  not in `all`: 512 sequences x 256 in x 512 out on a tiny CPU model with the decode forward and the sampler
        replaced by trivial functions, so each step's time is the engine's host-side (Python) work (the overlapped
        loop unless --no-overlap-schedule; wall and CPU time per decode step).

MBU (model bandwidth utilisation) = bytes that must be read / run time / peak bandwidth (4.25 TB/s, H200 HBM3e):
    bytes = num_forward_steps * weight_bytes + sum over requests of sum_{k=1}^{O-1} (P + k) * kv_bytes_per_token
i.e. every forward pass reads all weights once, and every decode step of a request with P prompt and O output
tokens reads the K/V of its current context (P + k tokens at its k-th decode step). Prefill compute, activations
and logits are not counted, so this is a lower bound of the traffic.

Checkpoints use random weights (speed does not depend on values), written as bf16 safetensors straight from
device tensors (no transformers model is instantiated), with a word-level tokenizer covering the vocabulary, so
nothing is downloaded. Not a quality benchmark.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import queue
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_checkpoints import build_checkpoint, make_prompts
from benchmarks.engine_host_step import HOST_STEP_PARTS, PREFILL_STEP_PARTS, bench_host_step
from benchmarks.engine_report import print_workload, summarize
from benchmarks.engine_tp import compare_tp
from benchmarks.engine_weights_memory import (
    bench_release_resume,
    bench_weight_update,
    free_device_memory,
    synchronize,
)
from benchmarks.engine_workloads import Workload, make_workload
from benchmarks.gpu_trace import StepTracer, gc_pauses

PEAK_BANDWIDTH_TB_S = 4.25  # H200 HBM3e
WORKLOADS = ("w1", "w2", "w3", "w4", "w5")

PRESETS = {
    "tiny": dict(num_prompts=16, input_len=32, output_len=64, device="cpu", dtype="float32"),
    "qwen3-0.6b": dict(num_prompts=256, input_len=256, output_len=256, device="cuda", dtype="bfloat16"),
    # The engine-speed issue's CPU bar: the quickstart's model (built by examples/quickstart/task.py), W1 only.
    "quickstart": dict(num_prompts=64, input_len=32, output_len=64, device="cpu", dtype="float32"),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--workload", default="w1",
                        help=f"one of {', '.join(WORKLOADS)}, a comma-separated list of them, 'all' or 'host'")
    parser.add_argument("--num-prompts", type=int, default=None, help="W1 / W4 only")
    parser.add_argument("--input-len", type=int, default=None, help="W1 / W4 only")
    parser.add_argument("--output-len", type=int, default=None, help="W1 / W4 only")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    parser.add_argument("--model-path", default=None, help="W1 only: benchmark this checkpoint instead of building one")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tp-size", type=int, default=1, help="also run each workload on an engine of N ranks")
    parser.add_argument("--ep-size", type=int, default=1, help="with --tp-size: expert parallelism inside the ranks")
    parser.add_argument("--overlap-schedule", action=argparse.BooleanOptionalAction, default=None,
                        help="the engine's overlapped scheduling (next decode step launched before the last one's "
                             "tokens reach the host); default: the engine's (on for CUDA)")
    parser.add_argument("--overlap-prefill", action=argparse.BooleanOptionalAction, default=None,
                        help="with overlapped scheduling, also launch the step after a prefill chunk before its "
                             "tokens reach the host; default: the engine's (on)")
    parser.add_argument("--prefill-cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                        help="prefill and mixed steps through piecewise CUDA graphs (prefill_graphs.py); default: "
                             "the engine's (on)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="the engine's token budget per step (the prefill chunk size, SGLang's "
                             "--chunked-prefill-size); default: the engine's")
    parser.add_argument("--num-kvcache-blocks", type=int, default=None,
                        help="the engine's KV-cache size in blocks (default: from --gpu-memory-utilization)")
    parser.add_argument("--kv-cache-dtype", default=None,
                        help="the engine's KV-cache dtype (auto, fp8_e4m3, fp8_e5m2; default: the engine's, the model "
                             "dtype); MBU then counts the bytes of that cache")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="the engine's share of device memory for weights and KV cache (default: the engine's)")
    parser.add_argument("--skip-hf", action="store_true", help="measure the engine only (no ratio) on every workload")
    parser.add_argument("--hf-workloads", default="w1",
                        help="comma-separated workloads on which HF generate is measured too, when they run "
                             "(default w1)")
    parser.add_argument("--peak-bandwidth-tb-s", type=float, default=PEAK_BANDWIDTH_TB_S)
    parser.add_argument("--trace-steps", type=int, default=0,
                        help="diagnosis: profile the first N steps of each timed run (host calls and GPU kernels) and "
                             "print where their time went; the run's tok/s then includes the profiler's overhead")
    parser.add_argument("--print-steps", action="store_true",
                        help="diagnosis: print every step's wall time (ms) of each timed run, in order")
    args = parser.parse_args(argv)
    for name, value in PRESETS[args.preset].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.workload not in ("all", "host"):
        names = [name.strip() for name in args.workload.split(",") if name.strip()]
        if not names or set(names) - set(WORKLOADS):
            raise ValueError(f"--workload {args.workload!r}: use one of {', '.join(WORKLOADS)}, a comma-separated "
                             "list of them, 'all' or 'host'")
        args.workload = ",".join(names)
    hf_workloads = {name.strip() for name in args.hf_workloads.split(",") if name.strip()}
    if hf_workloads - set(WORKLOADS):
        raise ValueError(f"--hf-workloads: unknown workload(s) {sorted(hf_workloads - set(WORKLOADS))}")
    args.hf_workloads = set() if args.skip_hf else hf_workloads - {"w4"}  # W4 is engine only
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but CUDA is not available; use --device cpu")
    if args.preset == "quickstart" and args.workload != "w1":
        raise ValueError("--preset quickstart runs --workload w1 only")
    if args.model_path and args.workload != "w1":
        raise ValueError("--model-path works with --workload w1 only (other workloads need their own shapes)")
    return args


# ---- measurements -----------------------------------------------------------------------------------------------

def bench_engine(model_path: Path, workload: Workload, args, measure_weights_and_memory: bool) -> dict:
    from slime.engine.engine import Engine
    from slime.engine.sampling_params import SamplingParams

    started = time.perf_counter()
    engine = Engine(
        str(model_path),
        device=args.device,
        dtype=args.dtype,
        max_model_len=max(map(len, workload.prompts)) + max(workload.max_new_tokens) + 16,
        max_num_seqs=len(workload.prompts),
        seed=args.seed,
        **getattr(args, "engine_parallel", {}),  # --tp-size's second run (engine_tp.py)
        **({} if args.overlap_schedule is None else {"overlap_schedule": args.overlap_schedule}),
        **({} if args.overlap_prefill is None else {"overlap_prefill": args.overlap_prefill}),
        **({} if args.prefill_cuda_graphs is None else {"prefill_cuda_graphs": args.prefill_cuda_graphs}),
        **({} if args.max_num_batched_tokens is None else {"max_num_batched_tokens": args.max_num_batched_tokens}),
        **{name: getattr(args, name) for name in ("num_kvcache_blocks", "gpu_memory_utilization", "kv_cache_dtype")
           if getattr(args, name) is not None},
    )
    init_seconds = time.perf_counter() - started
    # Warm-up: on CUDA the first decode step captures every CUDA graph; then forget the warm-up's prefixes.
    engine.generate(workload.prompts[:2], SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True))
    engine.flush_cache()
    synchronize(args.device)
    startup_seconds = time.perf_counter() - started

    for prompt, max_new_tokens in zip(workload.prompts, workload.max_new_tokens):
        params = SamplingParams(temperature=workload.temperature, top_p=1.0, top_k=-1,
                                max_new_tokens=max_new_tokens, ignore_eos=workload.ignore_eos)
        engine.add_request(prompt, params, incremental=False)  # as the server's non-streaming requests
    synchronize(args.device)
    gc.collect()
    gc.freeze()  # as the engine server does after start-up (slime.utils.misc.freeze_startup_objects)
    pauses = gc_pauses()
    # The finished requests' texts are decoded on another thread, as the server's event loop decodes them
    # (stop_strings.decode_final_texts), inside the timed run.
    text_batches: queue.SimpleQueue = queue.SimpleQueue()
    text_reader = threading.Thread(target=_decode_texts, args=(text_batches,), daemon=True)
    text_reader.start()
    started = time.perf_counter()
    finished = []
    step_ends = []
    tracer = StepTracer(args.device) if args.trace_steps else None
    while engine.has_unfinished_requests():
        step_finished = [output for output in engine.step() if output.finished]
        if step_finished:
            finished.extend(step_finished)
            text_batches.put(step_finished)
        step_ends.append(time.perf_counter())
        if tracer is not None and len(step_ends) == args.trace_steps:
            tracer.stop_and_print()
            tracer = None
    text_batches.put(None)
    text_reader.join()
    synchronize(args.device)
    seconds = time.perf_counter() - started
    gc.callbacks.remove(pauses.callback)
    gc.unfreeze()  # this process drops the engine next: its objects must be collectable again
    print(f"  garbage collections during the run: {len(pauses)}, longest {1000 * max(pauses, default=0):.1f} ms")
    num_steps = len(step_ends)
    step_seconds = np.diff([started] + step_ends)
    slowest = np.argsort(step_seconds)[::-1][:3]
    print("  slowest steps: " + ", ".join(f"#{i} {1000 * step_seconds[i]:.1f} ms" for i in slowest)
          + f"; median {1000 * np.median(step_seconds):.2f} ms")
    for when, text in getattr(args, "triton_compiles", []):
        if started <= when <= step_ends[-1]:
            print(f"  Triton compile inside the timed run, step #{int(np.searchsorted(step_ends, when))}: {text}")
    step_ms = np.round(1000 * step_seconds, 1)
    print(f"  step timeline (ms): first 12 {step_ms[:12].tolist()}, last 3 {step_ms[-3:].tolist()}; p10/p50/p90/p99 "
          + "/".join(f"{np.percentile(step_ms, q):.2f}" for q in (10, 50, 90, 99))
          + f"; sum of steps over 5 ms: {step_ms[step_ms > 5].sum():.0f} ms of {1000 * seconds:.0f}")
    if args.print_steps:
        print("  every step (ms): " + " ".join(f"{t:.1f}" for t in step_ms))

    runner = engine.model_runner
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    kv_bytes_per_token = runner.bytes_per_block // runner.block_size
    # Decode step k = 1 .. O-1 of a request reads the K/V of P + k tokens.
    kv_token_reads = sum((o.num_completion_tokens - 1) * (2 * o.num_prompt_tokens + o.num_completion_tokens) // 2
                         for o in finished)
    bytes_read = num_steps * weight_bytes + kv_token_reads * kv_bytes_per_token
    result = {
        "seconds": seconds,
        "num_output_tokens": sum(o.num_completion_tokens for o in finished),
        "num_requests_finished": len(finished),
        "num_steps": num_steps,
        "weight_bytes": weight_bytes,
        "bytes_read": bytes_read,
        "mbu": bytes_read / seconds / (args.peak_bandwidth_tb_s * 1e12),
        "init_seconds": init_seconds,
        "startup_seconds": startup_seconds,
        "num_prompt_tokens": sum(o.num_prompt_tokens for o in finished),
        "num_cached_prompt_tokens": sum(o.num_cached_tokens for o in finished),
        "block_size": runner.block_size,
        "overlap_schedule": engine.config.overlap_schedule,
        "max_num_batched_tokens": engine.config.max_num_batched_tokens,
        "overlap_prefill": engine.config.overlap_prefill,
        "prefill_cuda_graphs": engine.config.prefill_cuda_graphs and runner.use_cuda_graphs,
        "kv_cache_dtype": str(runner.kv_dtype).removeprefix("torch."),
    }
    if measure_weights_and_memory:
        result.update(bench_weight_update(engine, model_path, args.device))
        result.update(bench_release_resume(engine, workload.prompts, args.device))
    del engine, finished
    free_device_memory(args.device)
    return result


def bench_hf(model_path: Path, workload: Workload, args) -> dict:
    """HF generate, all prompts in one left-padded batch (equal lengths except W2); each row is cut to its own
    max_new_tokens when counting, as the engine produces exactly that many (generate runs to the longest)."""
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype, attn_implementation="sdpa")
    model.to(args.device).eval()
    width = max(map(len, workload.prompts))
    input_ids = torch.zeros(len(workload.prompts), width, dtype=torch.int64)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(workload.prompts):
        input_ids[row, width - len(prompt):] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt):] = 1
    input_ids, attention_mask = input_ids.to(args.device), attention_mask.to(args.device)
    max_new_tokens = max(workload.max_new_tokens)
    generate_kwargs = dict(do_sample=True, temperature=workload.temperature, top_k=0, top_p=1.0, pad_token_id=0,
                           max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens)
    with torch.inference_mode():
        model.generate(input_ids[:2], attention_mask=attention_mask[:2],
                       **{**generate_kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        synchronize(args.device)
        started = time.perf_counter()
        model.generate(input_ids, attention_mask=attention_mask, **generate_kwargs)
        synchronize(args.device)
        elapsed = time.perf_counter() - started
    del model
    free_device_memory(args.device)
    return {"seconds": elapsed, "num_output_tokens": sum(workload.max_new_tokens)}


# ---- report -----------------------------------------------------------------------------------------------------

def run_workloads(names: list[str], args) -> dict:
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_engine_") as tmp:
        checkpoints: dict[str, Path] = {}
        for name in names:
            workload = make_workload(name, args)
            key = json.dumps(workload.shape, sort_keys=True)
            if name == "w1" and args.preset == "quickstart" and not args.model_path:
                sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
                from examples.quickstart.task import build_task

                args.model_path = str(build_task(Path(tmp) / "quickstart")["model"])
            if name == "w1" and args.model_path:
                checkpoints[key] = Path(args.model_path)
                vocab_size = json.loads((checkpoints[key] / "config.json").read_text())["vocab_size"]
                workload.prompts = make_prompts(args.num_prompts, args.input_len, vocab_size, args.seed)
            if key not in checkpoints:
                for old_key, old in list(checkpoints.items()):  # e.g. W4's 8B checkpoint: drop the others' files
                    if Path(tmp) in old.parents:
                        _remove_tree(old)
                        del checkpoints[old_key]  # a later workload of that shape builds it again
                started = time.perf_counter()
                build_device = args.device if args.device == "cuda" else "cpu"
                checkpoints[key] = build_checkpoint(Path(tmp) / f"model_{name}", workload.shape,
                                                    getattr(torch, args.dtype), build_device, args.seed)
                print(f"[{name}] checkpoint built in {time.perf_counter() - started:.1f} s", flush=True)
            model_path = checkpoints[key]
            # HF first: it frees its memory before the engine sizes its KV cache from what is free.
            hf = bench_hf(model_path, workload, args) if name in args.hf_workloads else None
            engine = bench_engine(model_path, workload, args, measure_weights_and_memory=name == "w1")
            results[name] = summarize(workload, engine, hf, args.preset)
            if args.tp_size > 1:
                results[name]["tp"] = compare_tp(model_path, workload, args, engine, bench_engine)
            print_workload(results[name], flush=True)
    return results


def _remove_tree(path: Path) -> None:
    __import__("shutil").rmtree(path, ignore_errors=True)


def _decode_texts(batches: queue.SimpleQueue) -> None:
    from slime.engine.stop_strings import decode_final_texts

    while (batch := batches.get()) is not None:
        decode_final_texts(batch)


def main(argv=None) -> dict:
    import transformers

    args = parse_args(argv)
    torch.manual_seed(args.seed)
    if args.device == "cuda":
        from benchmarks.gpu_trace import log_triton_compiles

        args.triton_compiles = log_triton_compiles()  # bench_engine names any that land inside a timed run
    common = {
        "preset": args.preset,
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
        "dtype": args.dtype,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if args.workload == "host":
        result = {**bench_host_step(args.seed, overlap_schedule=args.overlap_schedule is not False), **common, "device": "cpu (device work faked)"}
        print(f"host-side time per decode step, {result['num_seqs']} seqs: mean {result['host_ms_per_step_mean']} ms, "
              f"median {result['host_ms_per_step_median']} ms (first 64 steps {result['host_ms_per_step_first_64']}"
              f" ms, last 64 {result['host_ms_per_step_last_64']} ms); CPU time median "
              f"{result['host_cpu_ms_per_step_median']} ms, mean {result['host_cpu_ms_per_step_mean']} ms")
        print(f"steps in which requests finished (ms, number): {result['host_ms_finishing_steps']}")
        for part, milliseconds in result["host_ms_per_step_parts"].items():
            print(f"  {part:16s} {milliseconds:7.3f} ms  {HOST_STEP_PARTS[part]}")
        print(f"host-side time per prefill step ({result['num_prefill_steps']} steps, forward faked too, not overlapped): "
              f"median {result['prefill_host_ms_per_step_median']} ms")
        for part, milliseconds in result["prefill_host_ms_per_step_parts"].items():
            print(f"  {part:16s} {milliseconds:7.3f} ms  {PREFILL_STEP_PARTS[part]}")
        print(json.dumps(result))
        return result
    names = list(WORKLOADS) if args.workload == "all" else args.workload.split(",")
    results = run_workloads(names, args)
    result = {"benchmark": "engine_vs_hf_generate", **common, "model": str(args.model_path or args.preset)}
    if "w1" in results:  # the W1 fields at the top level, as before workloads existed
        result.update(num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len)
        result.update({key: value for key, value in results["w1"].items() if key != "title"})
    result["workloads"] = results
    print("=" * 72)
    print(f"| preset {args.preset}, device {args.device} ({common['device_name']}), dtype {args.dtype}")
    print(f"| torch {torch.__version__}, transformers {transformers.__version__}")
    for name, summary in results.items():
        ratio = f" | {summary['ratio_engine_over_hf']}x hf" if summary["ratio_engine_over_hf"] else ""
        tp = summary.get("tp")
        tp = f" | TP={tp['tp_size']}: {tp['tpn_output_tok_s']} tok/s = {tp['tpn_over_tp1']}x TP=1" if tp else ""
        print(f"| {name}: {summary['engine_output_tok_s']} tok/s | MBU {summary['mbu']:.1%}{ratio}{tp}")
    print("=" * 72)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
