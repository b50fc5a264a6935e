"""The device operations a colocated hand-over is made of, each timed alone on the GPU with its bytes and bandwidth,
so a hand-over's parts (bench_handover.py, train.py's perf/* timers) can be read against them: device allocation
of a trainer's tensors one by one vs as one flat buffer, host <-> device copies from pinned vs pageable memory and
per tensor vs flat, freeing (empty_cache) of many blocks vs one, and the engine's KV cache: allocation alone, the
zero fill, the free. CUDA only; not a pass/fail test.

    python benchmarks/handover_primitives.py --shape qwen3-0.6b    # prints one JSON line, milliseconds and GB/s
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_checkpoints import SHAPES

KV_TENSORS = 2 * 28  # Qwen3-0.6B: K and V of 28 layers


def trainer_shapes(shape: dict) -> list[tuple[int, ...]]:
    """The parameter shapes of a dense Qwen3-style model (tied embeddings: one vocab matrix)."""
    hidden, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = shape.get("head_dim", hidden // heads)
    per_layer = [(heads * head_dim, hidden), (kv_heads * head_dim, hidden), (kv_heads * head_dim, hidden),
                 (hidden, heads * head_dim), (inter, hidden), (inter, hidden), (hidden, inter), (hidden,), (hidden,),
                 (head_dim,), (head_dim,)]
    return [(shape["vocab_size"], hidden)] + per_layer * layers + [(hidden,)]


def timed(fn, repeats: int) -> float:
    """Median seconds of `fn` (device work included), after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def measure(shapes: list[tuple[int, ...]], dtype: torch.dtype, kv_bytes: int, repeats: int) -> dict:
    numels = [torch.Size(s).numel() for s in shapes]
    num_bytes = sum(numels) * torch.empty((), dtype=dtype).element_size()
    results = {"tensors": len(shapes), "gb": num_bytes / 1e9, "kv_gb": kv_bytes / 1e9,
               **allocations(shapes, numels, dtype, repeats), **copies(shapes, numels, dtype, num_bytes, repeats),
               **kv_cache(kv_bytes, repeats),
               # the same at a tenth of the size: does the driver's cost scale with the bytes or per call?
               **{f"{key}_tenth": value for key, value in kv_cache(kv_bytes // 10, repeats).items()}}
    return {key: round(value, 3) if isinstance(value, float) else value for key, value in results.items()}


def allocations(shapes, numels, dtype, repeats) -> dict:
    def per_tensor():
        tensors = [torch.empty(s, dtype=dtype, device="cuda") for s in shapes]
        del tensors
        torch.cuda.empty_cache()

    def flat():
        buffer = torch.empty(sum(numels), dtype=dtype, device="cuda")
        del buffer
        torch.cuda.empty_cache()

    torch.cuda.empty_cache()
    return {"alloc_and_free_per_tensor_ms": timed(per_tensor, repeats) * 1e3,
            "alloc_and_free_flat_ms": timed(flat, repeats) * 1e3}


def copies(shapes, numels, dtype, num_bytes, repeats) -> dict:
    pinned = [torch.empty(s, dtype=dtype, pin_memory=True) for s in shapes]
    pageable = [torch.empty(s, dtype=dtype) for s in shapes]
    pinned_flat = torch.empty(sum(numels), dtype=dtype, pin_memory=True)
    device = [torch.empty(s, dtype=dtype, device="cuda") for s in shapes]
    device_flat = torch.empty(sum(numels), dtype=dtype, device="cuda")
    runs = {
        "h2d_pinned_per_tensor": lambda: [d.copy_(h, non_blocking=True) for d, h in zip(device, pinned)],
        "h2d_pinned_flat": lambda: device_flat.copy_(pinned_flat, non_blocking=True),
        "h2d_pageable_per_tensor": lambda: [d.copy_(h, non_blocking=True) for d, h in zip(device, pageable)],
        "d2h_pinned_per_tensor": lambda: [h.copy_(d, non_blocking=True) for d, h in zip(device, pinned)],
        "d2h_pinned_flat": lambda: pinned_flat.copy_(device_flat, non_blocking=True),
        # `.to` allocating each destination, as an offload does (pinned, from the caching host allocator)
        "to_host_per_tensor": lambda: [d.to("cpu", non_blocking=True) for d in device],
    }
    results = {}
    for name, run in runs.items():
        seconds = timed(run, repeats)
        results[f"{name}_ms"] = seconds * 1e3
        results[f"{name}_gb_per_s"] = num_bytes / 1e9 / seconds
    return results


def kv_cache(kv_bytes: int, repeats: int) -> dict:
    """An engine's KV cache (one bf16 allocation): allocate + free, zero-allocate + free, the zero fill alone."""
    def allocate_and_free(fill):
        def run():
            cache = fill(kv_bytes // 2, dtype=torch.bfloat16, device="cuda")
            del cache
            torch.cuda.empty_cache()
        return run

    def per_layer_and_free():  # the cache as it was before e1711af: one K and one V tensor per layer (28 layers)
        caches = [torch.empty(kv_bytes // 2 // KV_TENSORS, dtype=torch.bfloat16, device="cuda")
                  for _ in range(KV_TENSORS)]
        del caches
        torch.cuda.empty_cache()

    results = {"kv_empty_and_free_ms": timed(allocate_and_free(torch.empty), repeats) * 1e3,
               "kv_zeros_and_free_ms": timed(allocate_and_free(torch.zeros), repeats) * 1e3,
               "kv_per_layer_empty_and_free_ms": timed(per_layer_and_free, repeats) * 1e3}
    cache = torch.empty(kv_bytes // 2, dtype=torch.bfloat16, device="cuda")
    results["kv_zero_fill_ms"] = timed(cache.zero_, repeats) * 1e3
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--kv-fraction", type=float, default=0.8,
                        help="KV cache size as a fraction of the device (an engine at gpu_memory_utilization 0.9)")
    parser.add_argument("--repeats", type=int, default=5)
    cli = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("handover_primitives.py needs a CUDA device")
    _, total = torch.cuda.mem_get_info()
    shapes = trainer_shapes(SHAPES[cli.shape])
    print(json.dumps({"shape": cli.shape, "device": torch.cuda.get_device_name(), "dtype": "float32",
                      **measure(shapes, torch.float32, int(cli.kv_fraction * total), cli.repeats)}))


if __name__ == "__main__":
    main()
