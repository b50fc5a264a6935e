"""GPU micro-benchmark of the paged-attention Triton kernel alone (`slime/engine/layers/triton_paged_attention.py`)
on the Qwen3-0.6B attention shape (16 query heads, 8 KV heads, head dim 128) and SmolLM-135M's (9 / 3, head dim 64;
W5), bf16, KV block size 16, against torch
SDPA on the same K/V pre-gathered into dense tensors (the peer baseline: FlashAttention without paging; the gather
itself is not timed). Prints per case: us per call, achieved GB/s over the bytes the kernel must read (K/V of the
context once, plus q and out) against a 4.25 TB/s H200 ceiling, SDPA's time and the ratio, and the max abs error
against an fp32 SDPA reference (with bf16 SDPA's own error for scale). Summary card and a JSON last line.

    python benchmarks/bench_paged_attention.py           # the automatic config and split count, < 60 s
    python benchmarks/bench_paged_attention.py --sweep   # also decode tile/warp/stage configs and split counts
    python benchmarks/bench_paged_attention.py --kv-cache-dtype fp8_e4m3   # an fp8 cache: tiles in fp16 vs bf16

Cases: decode 256 seqs x 300 / 384 / 512 context (W1's decode steps from first to last; 384 its mean), decode 16 seqs
x 4096 context (split-KV), decode 512 x 384 on the 135M shape (W5's mean step), prefill 8 x 512 and 32 x 256 fresh
prompts (W1's chunk). `--sweep` times every decode config at split counts 1 and 2 (and the automatic one) on the
decode cases, and the prefill configs on the prefill cases. Timing: CUDA events around 100 back-to-back calls after
warm-up. Needs CUDA.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slime.engine.dtypes import to_cache_dtype
from slime.engine.layers import triton_paged_attention as kernel

BLOCK_SIZE = 16
QWEN3_06B = dict(num_heads=16, num_kv_heads=8, head_dim=128)
SMOLLM_135M = dict(num_heads=9, num_kv_heads=3, head_dim=64)
PEAK_BYTES_PER_S = 4.25e12
CASES = {
    "decode_256x300": dict(num_seqs=256, context=300, query_len=1, **QWEN3_06B),
    "decode_256x320": dict(num_seqs=256, context=320, query_len=1, **QWEN3_06B),
    "decode_256x321": dict(num_seqs=256, context=321, query_len=1, **QWEN3_06B),  # one key past a 64-key tile
    "decode_256x352": dict(num_seqs=256, context=352, query_len=1, **QWEN3_06B),
    "decode_256x384": dict(num_seqs=256, context=384, query_len=1, **QWEN3_06B),
    "decode_256x480": dict(num_seqs=256, context=480, query_len=1, **QWEN3_06B),
    "decode_256x512": dict(num_seqs=256, context=512, query_len=1, **QWEN3_06B),
    "decode_16x4096": dict(num_seqs=16, context=4096, query_len=1, **QWEN3_06B),
    "w5_decode_512x384": dict(num_seqs=512, context=384, query_len=1, **SMOLLM_135M),
    "prefill_8x512": dict(num_seqs=8, context=512, query_len=512, **QWEN3_06B),
    "prefill_32x256": dict(num_seqs=32, context=256, query_len=256, **QWEN3_06B),
}
_dot = functools.partial(kernel.KernelConfig, block_m=16, use_dot=True)
SWEEP_DECODE_CONFIGS = [
    kernel.KernelConfig(block_m=0, block_n=32, use_dot=False, num_warps=4, num_stages=2),
    _dot(block_n=16, num_warps=1, num_stages=4),
    _dot(block_n=32, num_warps=1, num_stages=4),
    _dot(block_n=32, num_warps=2, num_stages=2),
    _dot(block_n=32, num_warps=2, num_stages=3),
    _dot(block_n=32, num_warps=2, num_stages=4),  # DOT_DECODE_CONFIG before 2026-12-02
    _dot(block_n=32, num_warps=2, num_stages=6),
    _dot(block_n=32, num_warps=4, num_stages=4),
    _dot(block_n=32, num_warps=4, num_stages=3),
    _dot(block_n=16, num_warps=2, num_stages=4),
    _dot(block_n=16, num_warps=4, num_stages=4),
    _dot(block_n=64, num_warps=2, num_stages=3),
    _dot(block_n=64, num_warps=4, num_stages=2),
    _dot(block_n=64, num_warps=4, num_stages=3),
    _dot(block_n=64, num_warps=4, num_stages=4),
    _dot(block_n=128, num_warps=4, num_stages=2),
    _dot(block_n=128, num_warps=8, num_stages=2),
]
SWEEP_PREFILL_CONFIGS = [
    kernel.KernelConfig(block_m=m, block_n=n, use_dot=True, num_warps=w, num_stages=st)
    for m, n, w, st in [(64, 64, 4, 3), (64, 32, 4, 3),  # PREFILL_CONFIG before 2026-12-02, now (64, 128, 4, 2), (64, 64, 4, 2), (128, 64, 4, 3),
                        (128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 4, 3), (128, 128, 8, 2), (32, 64, 4, 3)]
]
SWEEP_SPLITS = [1, 2, 4, 8, 16]  # the automatic config at each


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--sweep", action="store_true", help="time kernel configs and split counts too (~2 min)")
    parser.add_argument("--spread-gb", type=float, default=0.0,
                        help="allocate each of the K and V caches this large and scatter the used blocks over all of "
                             "it, as in an engine whose cache fills the device (default: just the blocks needed)")
    parser.add_argument("--sweep-decode-configs", default="",
                        help="with --sweep: only these decode configs, as BLOCK_NxWARPSxSTAGES tensor-core tiles, "
                             "comma-separated (e.g. 16x1x4,64x2x3); default: the whole list")
    parser.add_argument("--kv-cache-dtype", choices=["bf16", "fp8_e4m3"], default="bf16",
                        help="the cache's dtype; fp8_e4m3 times the kernel with its tiles computed in fp16 "
                             "(FP8_KV_IN_FP16, the default) and in bf16, one after the other")
    parser.add_argument("--fp8-tiles", choices=["both", "fp16"], default="both",
                        help="with an fp8 cache: time fp16 and bf16 tiles (default), or the fp16 ones only")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {', '.join(CASES)}")
    args = parser.parse_args(argv)
    if args.iters < 1:
        raise ValueError(f"--iters must be >= 1, got {args.iters}")
    args.cases = [name.strip() for name in args.cases.split(",") if name.strip()]
    try:
        args.sweep_decode_configs = [_dot(block_n=n, num_warps=w, num_stages=st) for n, w, st in (
            map(int, item.split("x")) for item in args.sweep_decode_configs.split(",") if item.strip())]
    except ValueError:
        raise ValueError(f"--sweep-decode-configs {args.sweep_decode_configs!r}: use BLOCK_NxWARPSxSTAGES items, "
                         "e.g. 16x1x4,64x2x3") from None
    if not args.cases or set(args.cases) - set(CASES):
        raise ValueError(f"--cases {','.join(args.cases)!r}: use names from {', '.join(CASES)}")
    if not torch.cuda.is_available():
        raise ValueError("bench_paged_attention.py needs CUDA (the kernel has no CPU build)")
    return args


def make_case(num_seqs: int, context: int, query_len: int, num_heads: int, num_kv_heads: int, head_dim: int,
              seed: int = 0, spread_gb: float = 0.0, cache_dtype: torch.dtype = torch.bfloat16) -> dict:
    """Random cache with each sequence's blocks scattered (random permutation), as after some serving; with
    `spread_gb`, over a cache of that many GB each for K and V (only the used blocks hold random values). An fp8
    `cache_dtype` holds the bf16 values rounded as the engine stores them (dtypes.to_cache_dtype)."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    num_blocks_per_seq = -(-context // BLOCK_SIZE)
    num_used = num_seqs * num_blocks_per_seq
    block_bytes = BLOCK_SIZE * num_kv_heads * head_dim * 2
    num_blocks = max(num_used + 8, int(spread_gb * 1e9 // block_bytes))
    cache_shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    block_tables = torch.randperm(num_blocks, generator=generator, device="cuda")[:num_used]
    k_cache = torch.empty(cache_shape, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.empty(cache_shape, device="cuda", dtype=torch.bfloat16)
    for cache in (k_cache, v_cache):
        cache[block_tables] = torch.randn((num_used, *cache_shape[1:]), generator=generator, device="cuda",
                                          dtype=torch.bfloat16)
    if cache_dtype != torch.bfloat16:
        k_cache, v_cache = to_cache_dtype(k_cache, cache_dtype), to_cache_dtype(v_cache, cache_dtype)
    block_tables = block_tables.view(num_seqs, num_blocks_per_seq).to(torch.int32)
    q = torch.randn(num_seqs * query_len, num_heads, head_dim, generator=generator, device="cuda", dtype=torch.bfloat16)
    return dict(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables,
        query_start_loc=torch.arange(num_seqs + 1, device="cuda", dtype=torch.int32) * query_len,
        seq_lens=torch.full((num_seqs,), context, device="cuda", dtype=torch.int32),
        max_query_len=query_len,
        scale=head_dim**-0.5,
    )


def dense_inputs(case: dict, num_seqs: int, context: int, query_len: int, num_heads: int, num_kv_heads: int,
                 head_dim: int):
    """q [seqs, heads, query_len, dim] and K/V [seqs, kv_heads, context, dim] gathered through the block table."""
    positions = torch.arange(context, device="cuda")
    slots = case["block_tables"][:, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
    keys = case["k_cache"].view(-1, num_kv_heads, head_dim)[slots].to(torch.bfloat16).transpose(1, 2).contiguous()
    values = case["v_cache"].view(-1, num_kv_heads, head_dim)[slots].to(torch.bfloat16).transpose(1, 2).contiguous()
    queries = case["q"].view(num_seqs, query_len, num_heads, head_dim).transpose(1, 2).contiguous()
    return queries, keys, values


def sdpa(queries, keys, values, query_len: int, scale: float) -> torch.Tensor:
    out = F.scaled_dot_product_attention(queries, keys, values, is_causal=query_len > 1, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(-1, queries.shape[1], queries.shape[3])


def time_us(fn, iters: int) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def min_bytes(num_seqs: int, context: int, query_len: int, num_heads: int, num_kv_heads: int, head_dim: int,
              kv_element_size: int = 2) -> int:
    kv = 2 * num_seqs * context * num_kv_heads * head_dim * kv_element_size
    return kv + 2 * num_seqs * query_len * num_heads * head_dim * 2


def run_kernel(case: dict, config=None, num_kv_splits=None) -> torch.Tensor:
    return kernel.paged_attention(**case, config=config, num_kv_splits=num_kv_splits)


def bench_case(name: str, shape: dict, iters: int, sweep: bool, spread_gb: float = 0.0,
               cache_dtype: torch.dtype = torch.bfloat16, decode_configs=None) -> dict:
    case = make_case(**shape, spread_gb=spread_gb, cache_dtype=cache_dtype)
    queries, keys, values = dense_inputs(case, **shape)
    scale, query_len = case["scale"], shape["query_len"]
    expected = sdpa(queries.float(), keys.float(), values.float(), query_len, scale)
    out = run_kernel(case)
    sdpa_bf16 = sdpa(queries, keys, values, query_len, scale)
    config = kernel.choose_config(shape["num_heads"] // shape["num_kv_heads"], query_len,
                                  fp8_cache=case["k_cache"].element_size() == 1)
    num_kv_splits = kernel.choose_num_kv_splits(
        shape["num_seqs"], shape["num_kv_heads"], case["block_tables"].shape[1] * BLOCK_SIZE, query_len,
        config.block_n, case["q"].device,
    )
    kernel_us = time_us(lambda: run_kernel(case), iters)
    sdpa_us = time_us(lambda: sdpa(queries, keys, values, query_len, scale), iters)
    num_bytes = min_bytes(**shape, kv_element_size=case["k_cache"].element_size())
    fp8_tiles = "fp16" if kernel.FP8_KV_IN_FP16 else "bf16"
    if cache_dtype != torch.bfloat16:
        name = f"{name} fp8 ({fp8_tiles} tiles)"
    result = dict(
        case=name,
        **shape,
        config=config.__dict__,
        num_kv_splits=num_kv_splits,
        kernel_us=round(kernel_us, 2),
        kernel_gb_s=round(num_bytes / kernel_us / 1e3, 1),
        kernel_fraction_of_peak=round(num_bytes / kernel_us / 1e6 / PEAK_BYTES_PER_S, 3),
        sdpa_us=round(sdpa_us, 2),
        sdpa_over_kernel=round(sdpa_us / kernel_us, 3),
        max_abs_err=(out.float() - expected).abs().max().item(),
        sdpa_bf16_max_abs_err=(sdpa_bf16.float() - expected).abs().max().item(),
        min_bytes=num_bytes,
    )
    print(
        f"{name}: kernel {kernel_us:.1f} us ({result['kernel_gb_s']:.0f} GB/s, "
        f"{100 * result['kernel_fraction_of_peak']:.0f}% of 4.25 TB/s) | SDPA {sdpa_us:.1f} us "
        f"(SDPA / kernel {result['sdpa_over_kernel']:.2f}x) | max abs err {result['max_abs_err']:.2e} "
        f"(bf16 SDPA {result['sdpa_bf16_max_abs_err']:.2e}) | splits {num_kv_splits}, {config}",
        flush=True,
    )
    if sweep:
        result["sweep"] = sweep_configs(case, expected, num_bytes, iters, num_kv_splits, decode=query_len == 1,
                                        decode_configs=decode_configs)
    return result


def sweep_configs(case: dict, expected: torch.Tensor, num_bytes: int, iters: int, num_kv_splits: int,
                  decode: bool, decode_configs=None) -> list:
    """Decode: every decode config at 1 and 2 splits (and the automatic count), then the automatic config at every
    split count. Prefill: every prefill config (no splits)."""
    if decode:
        runs = [(config, splits) for config in decode_configs or SWEEP_DECODE_CONFIGS
                for splits in sorted({1, 2, num_kv_splits})]
        runs += [(None, splits) for splits in SWEEP_SPLITS if splits != num_kv_splits]
    else:
        runs = [(config, 1) for config in SWEEP_PREFILL_CONFIGS]
    rows = []
    for config, splits in runs:
        err = (run_kernel(case, config, splits).float() - expected).abs().max().item()
        us = time_us(lambda: run_kernel(case, config, splits), iters)
        label = "auto" if config is None else config.__dict__
        gb_s = num_bytes / us / 1e3
        rows.append(dict(config=label, num_kv_splits=splits, us=round(us, 2), gb_s=round(gb_s, 1), max_abs_err=err))
        print(f"    {us:8.1f} us {gb_s:6.0f} GB/s  err {err:.1e}  splits {splits:2d}  {label}", flush=True)
    best = min(rows, key=lambda row: row["us"])
    print(f"    best: {best['us']:.1f} us, splits {best['num_kv_splits']}, {best['config']}", flush=True)
    return rows


def main(argv=None) -> dict:
    args = parse_args(argv)
    import triton

    if args.kv_cache_dtype == "bf16":
        results = [bench_case(name, CASES[name], args.iters, args.sweep, args.spread_gb,
                              decode_configs=args.sweep_decode_configs) for name in args.cases]
    else:  # the fp8 cache read in fp16 tiles, then in bf16 ones (the kernel's switch), same cases
        results = []
        for in_fp16 in (True, False) if args.fp8_tiles == "both" else (True,):
            kernel.FP8_KV_IN_FP16 = in_fp16
            results += [bench_case(name, CASES[name], args.iters, args.sweep, args.spread_gb, torch.float8_e4m3fn,
                                   args.sweep_decode_configs) for name in args.cases]
        kernel.FP8_KV_IN_FP16 = True
    device_name = torch.cuda.get_device_name()
    summary = dict(
        benchmark="paged_attention",
        date=datetime.date.today().isoformat(),
        device=device_name,
        torch=torch.__version__,
        triton=triton.__version__,
        kv_block_size=BLOCK_SIZE,
        dtype="bfloat16",
        kv_cache_dtype=args.kv_cache_dtype,
        cases=results,
    )
    print("=" * 72)
    print(f"| paged attention, {device_name}, torch {torch.__version__}, triton {triton.__version__}")
    for row in results:
        print(f"| {row['case']:<32} {row['kernel_us']:8.1f} us {row['kernel_gb_s']:7.0f} GB/s "
              f"({100 * row['kernel_fraction_of_peak']:3.0f}% peak)  SDPA {row['sdpa_us']:8.1f} us  "
              f"err {row['max_abs_err']:.1e}")
    print("=" * 72)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
