"""The log-prob head on CUDA: the torch path (`log_probs._ChunkedLogProbs`, fp32 elementwise passes over each
1024-token chunk of logits) against the fused Triton path (`triton_log_probs`, one kernel pass over bf16 logits
each way, 4096-token chunks by default; also at 1024 to separate the kernels from the chunk size), in one process.

Per hidden size: forward only (no grad, as for old / reference log-probs) and forward + backward of a loss on
log-probs, and on log-probs + entropy. CUDA-event timing (median) after warm-up; peak memory above the inputs; max
abs differences against the torch path. Then the two kernels alone on one [4096, V] bf16 chunk, with the bandwidth
they reach (--sweep-blocks: over block sizes and warps). Prints a summary card and a JSON last line.

    python benchmarks/bench_log_probs.py                    # N = 16384, H = 1024 and 2048, V = 151936, bf16
    python benchmarks/bench_log_probs.py --sweep-blocks
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slime.backends import triton_log_probs
from slime.backends.log_probs import (
    chunked_log_probs_and_entropy,
    torch_chunked_log_probs_and_entropy,
    uses_fused_path,
)

PATHS = {
    "torch": lambda h, w, t, temperature: torch_chunked_log_probs_and_entropy(h, w, t, temperature, 1024),
    "fused": lambda h, w, t, temperature: chunked_log_probs_and_entropy(h, w, t, temperature, None),
    "fused_chunk1024": lambda h, w, t, temperature: chunked_log_probs_and_entropy(h, w, t, temperature, 1024),
}
MODES = ("forward", "lp", "lp+ent")  # forward only; backward of log-probs; backward of log-probs + entropy
KERNEL_CHUNK = 4096
SWEEP = [(1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 16)]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-tokens", type=int, default=16384)
    parser.add_argument("--hidden-sizes", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--vocab-size", type=int, default=151936)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--sweep-blocks", action="store_true", help="time the kernels over (BLOCK_V, num_warps)")
    return parser.parse_args(argv)


def cuda_time_ms(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def run_path(path, mode, hidden, weight, targets, upstream, temperature):
    """One call of the head (and its backward unless mode is 'forward'): (log_probs, entropy, grads or None)."""
    function = PATHS[path]
    if mode == "forward":
        with torch.no_grad():
            return (*function(hidden, weight, targets, temperature), None)
    hidden, weight = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    log_probs, entropy = function(hidden, weight, targets, temperature)
    loss = (log_probs * upstream[0]).sum()
    if mode == "lp+ent":
        loss = loss + (entropy * upstream[1]).sum()
    return log_probs.detach(), entropy.detach(), torch.autograd.grad(loss, (hidden, weight))


def peak_memory_mb(fn):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def max_abs_diff(result, reference):
    log_probs, entropy, grads = result
    ref_log_probs, ref_entropy, ref_grads = reference
    diffs = {"log_probs": (log_probs - ref_log_probs).abs().max().item(),
             "entropy": (entropy - ref_entropy).abs().max().item()}
    if grads is not None:
        for name, got, want in zip(("grad_hidden", "grad_weight"), grads, ref_grads):
            diffs[name] = (got.float() - want.float()).abs().max().item()
            diffs[name + "_ref_max"] = want.float().abs().max().item()
    return diffs


def bench_head(args, hidden_size):
    generator = torch.Generator(device="cuda").manual_seed(hidden_size)
    num_tokens, vocab_size = args.num_tokens, args.vocab_size
    hidden = torch.randn(num_tokens, hidden_size, device="cuda", generator=generator).bfloat16()
    # Logits of std ~2, a plausible scale for a trained LM head.
    weight = (torch.randn(vocab_size, hidden_size, device="cuda", generator=generator) * 2 / hidden_size**0.5)
    weight = weight.bfloat16()
    targets = torch.randint(0, vocab_size, (num_tokens,), device="cuda", generator=generator)
    upstream = torch.randn(2, num_tokens, device="cuda", generator=generator) / num_tokens
    rows = []
    for mode in MODES:
        reference = run_path("torch", mode, hidden, weight, targets, upstream, args.temperature)
        for path in PATHS:
            def call():
                return run_path(path, mode, hidden, weight, targets, upstream, args.temperature)

            ms = cuda_time_ms(call, args.warmup, args.iters)
            row = dict(hidden_size=hidden_size, mode=mode, path=path, ms=round(ms, 3),
                       tokens_per_s=round(num_tokens / ms * 1e3), peak_mb=round(peak_memory_mb(call)),
                       max_abs_diff={k: float(f"{v:.3g}") for k, v in max_abs_diff(call(), reference).items()})
            rows.append(row)
            print(f"H={hidden_size:5d} {mode:8s} {path:16s} {ms:9.2f} ms  peak {row['peak_mb']:7d} MB  "
                  f"diff {row['max_abs_diff']}", flush=True)
        del reference
    return rows


def bench_kernels(args, configs):
    """logits_stats and logits_grad_ alone on one [4096, V] bf16 chunk: time and bandwidth (bytes each must move:
    stats reads the chunk once; the grad kernel reads and writes it once)."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(KERNEL_CHUNK, args.vocab_size, device="cuda", generator=generator) * 2).bfloat16()
    targets = torch.randint(0, args.vocab_size, (KERNEL_CHUNK,), device="cuda", generator=generator)
    upstream = torch.randn(2, KERNEL_CHUNK, device="cuda", generator=generator)
    chunk_bytes = logits.numel() * logits.element_size()
    defaults = {name: getattr(triton_log_probs, name)
                for name in ("STATS_BLOCK_V", "STATS_NUM_WARPS", "GRAD_BLOCK_V", "GRAD_NUM_WARPS")}
    rows = []
    try:
        for block_v, num_warps in configs:
            triton_log_probs.STATS_BLOCK_V, triton_log_probs.STATS_NUM_WARPS = block_v, num_warps
            triton_log_probs.GRAD_BLOCK_V, triton_log_probs.GRAD_NUM_WARPS = block_v, num_warps
            _, entropy, row_max, log_sum_exp = triton_log_probs.logits_stats(logits, targets, args.temperature)
            stats_ms = cuda_time_ms(lambda: triton_log_probs.logits_stats(logits, targets, args.temperature),
                                    args.warmup, args.iters)
            scratch = logits.clone()
            grad_ms = cuda_time_ms(lambda: triton_log_probs.logits_grad_(
                scratch, targets, row_max, log_sum_exp, entropy, upstream[0], upstream[1], args.temperature),
                args.warmup, args.iters)
            row = dict(block_v=block_v, num_warps=num_warps, stats_ms=round(stats_ms, 3), grad_ms=round(grad_ms, 3),
                       stats_gb_per_s=round(chunk_bytes / stats_ms / 1e6),
                       grad_gb_per_s=round(2 * chunk_bytes / grad_ms / 1e6))
            rows.append(row)
            print(f"kernels [{KERNEL_CHUNK}, {args.vocab_size}] bf16 BLOCK_V={block_v:5d} warps={num_warps:2d}: "
                  f"stats {stats_ms:.3f} ms ({row['stats_gb_per_s']} GB/s), "
                  f"grad {grad_ms:.3f} ms ({row['grad_gb_per_s']} GB/s)", flush=True)
    finally:
        for name, value in defaults.items():
            setattr(triton_log_probs, name, value)
    return rows


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_log_probs.py needs CUDA (the fused path is CUDA-only)")
    probe = torch.empty(1, device="cuda")
    if not uses_fused_path(probe, probe):
        raise SystemExit("triton is not installed: no fused path to measure")
    import triton

    head_rows = [row for hidden_size in args.hidden_sizes for row in bench_head(args, hidden_size)]
    default_config = (triton_log_probs.STATS_BLOCK_V, triton_log_probs.STATS_NUM_WARPS)
    kernel_rows = bench_kernels(args, SWEEP if args.sweep_blocks else [default_config])

    speedups = {}
    print("\n=== log-prob head: torch vs fused Triton ===")
    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
          f"N={args.num_tokens} V={args.vocab_size} bf16 T={args.temperature}")
    for hidden_size in args.hidden_sizes:
        for mode in MODES:
            by_path = {row["path"]: row for row in head_rows
                       if row["hidden_size"] == hidden_size and row["mode"] == mode}
            key = f"H{hidden_size}_{mode}"
            speedups[key] = round(by_path["torch"]["ms"] / by_path["fused"]["ms"], 2)
            cells = " | ".join(f"{path} {row['ms']:8.2f} ms / {row['peak_mb']:6d} MB" for path, row in by_path.items())
            print(f"H={hidden_size:5d} {mode:8s} {cells} | speedup x{speedups[key]}")
    print(json.dumps(dict(
        benchmark="log_probs_head", date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name(),
        torch=torch.__version__, triton=triton.__version__, num_tokens=args.num_tokens, vocab_size=args.vocab_size,
        temperature=args.temperature, speedup_fused_over_torch=speedups, head=head_rows, kernels=kernel_rows,
    )))


if __name__ == "__main__":
    main()
