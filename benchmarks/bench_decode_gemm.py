"""GPU micro-benchmark of a decode step's matmuls alone: each linear layer of the Qwen3-0.6B shape (qkv, o, gate_up,
down, lm_head) at W1's batch (256 rows) and of the SmolLM-135M shape at W5's (512 rows), bf16, timed the way a decode
step runs them: inside a CUDA graph, one call per layer on that layer's own weight copy (so the weights come from HBM,
not from the L2 cache, as in a real step). Per shape: cuBLAS (`F.linear`, the engine's path), the best of a sweep of
Triton tile / split-K configs (the kernel below: small output tiles, an optional split of K whose float32 partial
sums a second kernel adds and rounds once), the floor (max of the weight read at the
measured copy bandwidth and the FLOPs at the measured matmul peak), and the step total over all layers.

    python benchmarks/bench_decode_gemm.py [--rows 256] [--quick]

A diagnosis tool: it says whether the decode matmuls have room below cuBLAS and which config takes it. Needs CUDA.
Summary card and a JSON last line. Result on an H200 (2026-12-03, benchmarks/RESULTS.md): cuBLAS won every shape
(0.918 ms of matmuls per W1 step against 1.211 for the best Triton configs and a 0.384 ms floor), so the engine
keeps cuBLAS and the Triton kernel lives here only as the comparison.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_checkpoints import QWEN3_06B_SHAPE, SMOLLM_135M_SHAPE

PEAK_BYTES_PER_S = 4.25e12  # device-to-device copy on the H200 (FACTS.md)
PEAK_FLOPS = 795e12  # 8192^3 bf16 matmul on the H200 (FACTS.md)
NUM_GRAPH_REPLAYS = 20


@triton.jit
def _linear_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_out, stride_split,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    # The M tiles of one N tile are neighbours in launch order: they read the same weight tile while it is in L2.
    num_m_tiles = tl.cdiv(M, BLOCK_M)
    tile = tl.program_id(0)
    split = tl.program_id(1)
    tile_n = tile // num_m_tiles
    tile_m = tile % num_m_tiles
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    columns = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_begin = split * k_per_split
    offsets = tl.arange(0, BLOCK_K)
    x_block = x_ptr + rows[:, None].to(tl.int64) * stride_x + offsets[None, :]
    w_block = w_ptr + columns[:, None].to(tl.int64) * stride_w + offsets[None, :]
    accumulator = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_begin, tl.minimum(k_begin + k_per_split, K), BLOCK_K):
        in_k = (k + offsets) < K
        x = tl.load(x_block + k, mask=(rows[:, None] < M) & in_k[None, :], other=0.0)
        w = tl.load(w_block + k, mask=(columns[:, None] < N) & in_k[None, :], other=0.0)
        accumulator = tl.dot(x, tl.trans(w), accumulator)
    out = out_ptr + split.to(tl.int64) * stride_split + rows[:, None].to(tl.int64) * stride_out + columns[None, :]
    tl.store(out, accumulator.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (columns[None, :] < N))


@triton.jit
def _sum_splits_kernel(partial_ptr, out_ptr, num_elements, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = offsets < num_elements
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):
        total += tl.load(partial_ptr + split * num_elements + offsets, mask=valid, other=0.0)
    tl.store(out_ptr + offsets, total.to(out_ptr.dtype.element_ty), mask=valid)


DEFAULT_CONFIG = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, SPLIT_K=1, num_warps=4, num_stages=3)
SUM_BLOCK = 1024


def linear(x: torch.Tensor, weight: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """x [M, K] (rows contiguous) @ weight[N, K]^T -> [M, N] in x's dtype, with `config` (tile sizes BLOCK_M /
    BLOCK_N / BLOCK_K, SPLIT_K, num_warps, num_stages; default DEFAULT_CONFIG)."""
    config = dict(DEFAULT_CONFIG, **(config or {}))
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not multiply as x @ w.T")
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    (num_rows, num_in), num_out = x.shape, weight.shape[0]
    split_k = config.pop("SPLIT_K")
    out = torch.empty(num_rows, num_out, dtype=x.dtype, device=x.device)
    target = out if split_k == 1 else torch.empty(split_k, num_rows, num_out, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(num_rows, config["BLOCK_M"]) * triton.cdiv(num_out, config["BLOCK_N"]), split_k)
    _linear_kernel[grid](x, weight, target, num_rows, num_out, num_in, x.stride(0), weight.stride(0), num_out,
                         num_rows * num_out, SPLIT_K=split_k, **config)
    if split_k > 1:
        _sum_splits_kernel[(triton.cdiv(out.numel(), SUM_BLOCK),)](target, out, out.numel(), SPLIT_K=split_k,
                                                                    BLOCK=SUM_BLOCK)
    return out


def linear_shapes(shape: dict) -> list[tuple[str, int, int, int]]:
    """(name, N, K, layers) of each linear layer of a dense decoder: out features, in features, how many per step."""
    hidden, heads, kv_heads = shape["hidden_size"], shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = shape.get("head_dim", hidden // heads)
    layers = shape["num_hidden_layers"]
    return [
        ("qkv_proj", (heads + 2 * kv_heads) * head_dim, hidden, layers),
        ("o_proj", hidden, heads * head_dim, layers),
        ("gate_up_proj", 2 * shape["intermediate_size"], hidden, layers),
        ("down_proj", hidden, shape["intermediate_size"], layers),
        ("lm_head", shape["vocab_size"], hidden, 1),
    ]


def configs(quick: bool) -> list[dict]:
    tiles = [(64, 64, 128), (64, 128, 64), (128, 64, 64), (128, 128, 64), (64, 32, 128), (128, 32, 128),
             (256, 64, 64), (256, 128, 64)]
    found = []
    for block_m, block_n, block_k in tiles:
        for num_warps in (4, 8):
            for split_k in (1, 2, 4):
                if quick and (num_warps, split_k) not in ((4, 1), (8, 1), (4, 2)):
                    continue
                found.append(dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
                                  num_warps=num_warps, num_stages=4 if block_k == 64 else 3))
    return found


def graph_microseconds(run_all_layers, num_layers: int) -> float:
    """Mean GPU time of one layer's call: all layers' calls captured in one CUDA graph, replayed."""
    run_all_layers()  # compile / pick kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_all_layers()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(NUM_GRAPH_REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / NUM_GRAPH_REPLAYS / num_layers


def bench_shape(name: str, rows: int, out_features: int, in_features: int, num_layers: int, quick: bool) -> dict:
    x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16)
    # Enough weight copies that a graph of them overflows the L2 cache (50 MB) like a real step's layers.
    num_copies = max(num_layers, -(-200 * 2**20 // (2 * out_features * in_features)))
    weights = [torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16) / in_features ** 0.5
               for _ in range(num_copies)]
    reference = F.linear(x.float(), weights[0].float())
    cublas_us = graph_microseconds(lambda: [F.linear(x, w) for w in weights], num_copies)
    cublas_error = (F.linear(x, weights[0]).float() - reference).abs().max().item()
    results = []
    for config in configs(quick):
        try:
            out = linear(x, weights[0], config=config)
        except Exception as error:  # noqa: BLE001 - a config the compiler refuses (shared memory) is skipped, named
            print(f"  {name} {config}: skipped ({type(error).__name__})")
            continue
        error = (out.float() - reference).abs().max().item()
        if error > 4 * cublas_error + 1e-2:
            raise AssertionError(f"{name} {config}: max error {error} against cuBLAS's {cublas_error}")
        us = graph_microseconds(lambda config=config: [linear(x, w, config=config) for w in weights], num_copies)
        results.append((us, config))
    results.sort(key=lambda item: item[0])
    weight_bytes = 2 * out_features * in_features
    floor_us = 1e6 * max(weight_bytes / PEAK_BYTES_PER_S, 2 * rows * out_features * in_features / PEAK_FLOPS)
    best_us, best = results[0] if results else (float("nan"), None)
    return dict(name=name, rows=rows, out_features=out_features, in_features=in_features, layers=num_layers,
                cublas_us=cublas_us, triton_us=best_us, triton_config=best, floor_us=floor_us,
                top3=[(round(us, 2), config) for us, config in results[:3]])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer configs (4 warps or 8, split-K 1 or 2)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode_gemm.py needs CUDA")
    started = time.perf_counter()
    rows = []
    for model, shape, batch in (("qwen3-0.6b", QWEN3_06B_SHAPE, 256), ("smollm-135m", SMOLLM_135M_SHAPE, 512)):
        step = dict(cublas=0.0, triton=0.0, best=0.0, floor=0.0)
        for name, out_features, in_features, num_layers in linear_shapes(shape):
            row = bench_shape(name, batch, out_features, in_features, num_layers, args.quick)
            row["model"] = model
            rows.append(row)
            step["cublas"] += num_layers * row["cublas_us"]
            step["triton"] += num_layers * row["triton_us"]
            step["best"] += num_layers * min(row["cublas_us"], row["triton_us"])
            step["floor"] += num_layers * row["floor_us"]
            print(f"{model} {name:13s} [{batch} x {in_features}] x [{in_features} x {out_features}]: cuBLAS "
                  f"{row['cublas_us']:7.2f} us, Triton best {row['triton_us']:7.2f} us ({row['triton_config']}), "
                  f"floor {row['floor_us']:6.2f} us; top 3 {row['top3']}", flush=True)
        print(f"{model} per decode step (ms): cuBLAS {step['cublas'] / 1000:.3f}, Triton best {step['triton'] / 1000:.3f}, "
              f"best of both {step['best'] / 1000:.3f}, floor {step['floor'] / 1000:.3f}\n")
        rows.append(dict(model=model, step_ms={key: value / 1000 for key, value in step.items()}))
    summary = dict(benchmark="decode_gemm", date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name(),
                   torch=torch.__version__, seconds=round(time.perf_counter() - started, 1), rows=rows)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
