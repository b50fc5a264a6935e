"""Causal varlen attention of the trainer, forward + backward, on the packed micro-batches of `bench_train.py`:
FlashAttention (torch's built-in FA2, slime's op with grouped K/V) against the same kernel with K/V repeated to the
query heads (what torch 2.11's `varlen_attn` needs). Checks the second against the first (output and gradients), then
prints a table and a JSON last line. (cuDNN's SDPA on the same ragged layout, `aten._cudnn_attention_forward` with
cum_seq_q/k, ran into an illegal memory access in its backward on torch 2.11 + H200, 2026-11-29; not used.)

    python benchmarks/bench_varlen_attention.py --model-shape qwen3-4b

FLOPs per sample of length n: forward 4 * n^2 / 2 * heads * head_dim (causal half of QK^T and PV), backward 2.5x
that (the usual FlashAttention accounting). GPU only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_train import SHAPES, make_samples


def timed(fn, num_iters):
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(num_iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / num_iters


def main():
    from slime.backends.attention import flash_varlen_causal
    from slime.backends.packing import cu_seqlens_of, split_micro_batches

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-shape", choices=sorted(SHAPES), default="qwen3-4b")
    parser.add_argument("--max-tokens-per-gpu", type=int, default=16384)
    parser.add_argument("--num-iters", type=int, default=5)
    opts = parser.parse_args()
    shape = SHAPES[opts.model_shape]
    num_heads, num_kv_heads, head_dim = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    tokens, _, _ = make_samples(32, 256, 256, 4096, shape["vocab_size"])
    lengths = [len(t) for t in tokens]
    # The trainer's own packing (--use-dynamic-batch-size): sample lengths per micro-batch.
    bins = [[lengths[i] for i in bin_] for bin_ in
            split_micro_batches(list(range(len(tokens))), lengths, len(tokens), opts.max_tokens_per_gpu)]
    scale = head_dim ** -0.5
    flops = sum(2 * n * n * num_heads * head_dim for bin_ in bins for n in bin_) * 3.5  # fwd 1 + bwd 2.5
    torch.manual_seed(0)
    inputs = []
    for bin_ in bins:
        total = sum(bin_)
        q = torch.randn(total, num_heads, head_dim, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(total, num_kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(total, num_kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
        inputs.append((q, k, v, cu_seqlens_of(bin_).cuda(), max(bin_), torch.randn_like(q)))
    repeat = num_heads // num_kv_heads

    def flash(q, k, v, cu, max_len, grad_out):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out, _ = flash_varlen_causal(q, k, v, cu, max_len, scale)
        out.backward(grad_out)
        return out, q.grad, k.grad, v.grad

    def flash_repeated(q, k, v, cu, max_len, grad_out):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        k_full, v_full = (t.repeat_interleave(repeat, dim=1) for t in (k, v))
        out, _ = flash_varlen_causal(q, k_full, v_full, cu, max_len, scale)
        out.backward(grad_out)
        return out, q.grad, k.grad, v.grad

    rows, reference = [], [flash(*x) for x in inputs]
    for name, fn in (("flash, grouped K/V (slime)", flash), ("flash, K/V repeated", flash_repeated)):
        results = [fn(*x) for x in inputs]
        errors = [max((a.float() - b.float()).abs().max().item() for a, b in zip(got, want))
                  for got, want in zip(results, reference)]
        seconds = timed(lambda: [fn(*x) for x in inputs], opts.num_iters)
        rows.append(dict(kernel=name, seconds=seconds, tflops=flops / seconds / 1e12, max_abs_diff=max(errors)))
    print(f"=== varlen attention fwd+bwd: {opts.model_shape} heads {num_heads}/{num_kv_heads}x{head_dim}, "
          f"{len(bins)} micro-batches of <= {opts.max_tokens_per_gpu} tokens (per layer) ===")
    for row in rows:
        print(f"{row['kernel']:<28} {row['seconds'] * 1e3:8.2f} ms  {row['tflops']:6.1f} TFLOP/s  "
              f"max |diff| vs flash {row['max_abs_diff']:.3g}")
    print(json.dumps({"bench": "varlen_attention", "model_shape": opts.model_shape, "gpu": torch.cuda.get_device_name(),
                      "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "rows": rows}))


if __name__ == "__main__":
    main()
