"""GPU micro-benchmark of the absorbed-MLA Triton kernel alone (`slime/engine/layers/triton_mla_decode.py`) over a
paged latent cache (kv_lora_rank 512 + rope 64 per token, bf16, KV block size 16), on Moonlight-16B's and
GLM-4.7-Flash's heads (16 / 20) and DeepSeek-V3's (128), against the peer baseline: torch SDPA on the same latent
rows pre-gathered into dense tensors (one KV head, V = the first 512 columns; the gather itself is not timed).

Prints per case: us per call; the bytes the kernel must move (every sequence's latent rows once, plus q and the
output) and the achieved GB/s against the device-to-device copy bandwidth measured in the same run (the floor's
time is bytes / that bandwidth); SDPA's time and the ratio; the max abs error against an fp32 reference. Summary
card and a JSON last line.

    python benchmarks/bench_mla_decode.py            # every case, < 60 s on an H200
    python benchmarks/bench_mla_decode.py --sweep    # also block_m / block_n / warps / stages and split counts

Needs CUDA.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slime.engine.layers import triton_mla_decode as kernel

BLOCK_SIZE, LATENT, ROPE = 16, 512, 64
CASES = {  # heads, seqs, context
    "moonlight_decode_256x384": (16, 256, 384),
    "moonlight_decode_64x2048": (16, 64, 2048),
    "glm47flash_decode_256x384": (20, 256, 384),
    "deepseek_v3_decode_64x1024": (128, 64, 1024),
    "deepseek_v3_decode_8x4096": (128, 8, 4096),
}
SWEEP = [kernel.MLAKernelConfig(block_m=m, block_n=n, num_warps=w, num_stages=s)
         for m in (16, 32, 64) for n in (16, 32, 64) for w in (4, 8) for s in (2, 3)]


def time_us(function, iters: int) -> float:
    for _ in range(3):
        function()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        function()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def copy_bandwidth(iters: int) -> float:
    """Device-to-device copy bytes per second (read + write) of a 1 GiB buffer: the floor's bandwidth."""
    source = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    return 2 * source.numel() / (time_us(lambda: target.copy_(source), iters) * 1e-6)


def run_case(name: str, heads: int, num_seqs: int, context: int, iters: int, bandwidth: float,
             sweep: bool) -> dict:
    blocks_per_seq = -(-context // BLOCK_SIZE)
    cache = torch.randn(num_seqs * blocks_per_seq + 1, BLOCK_SIZE, 1, LATENT + ROPE, device="cuda",
                        dtype=torch.bfloat16)
    block_tables = torch.randperm(num_seqs * blocks_per_seq, device="cuda").view(num_seqs, blocks_per_seq).int()
    q = torch.randn(num_seqs, heads, LATENT + ROPE, device="cuda", dtype=torch.bfloat16)
    query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32, device="cuda")
    scale = 192**-0.5

    def run(config=None, splits=None):
        return kernel.mla_attention(q, cache, block_tables, query_start_loc, seq_lens, 1, scale, LATENT,
                                    config=config, num_kv_splits=splits)

    rows = cache[block_tables.long()].view(num_seqs, -1, LATENT + ROPE)[:, :context].unsqueeze(1)  # dense copy
    def sdpa():
        return F.scaled_dot_product_attention(q.unsqueeze(2), rows, rows[..., :LATENT], scale=scale,
                                              enable_gqa=True)

    reference = F.scaled_dot_product_attention(q.float().unsqueeze(2), rows.float(), rows[..., :LATENT].float(),
                                               scale=scale, enable_gqa=True).squeeze(2)
    error = (run().float() - reference).abs().max().item()
    kernel_us, sdpa_us = time_us(run, iters), time_us(sdpa, iters)
    moved = num_seqs * context * (LATENT + ROPE) * 2 + q.numel() * 2 + num_seqs * heads * LATENT * 2
    result = dict(case=name, heads=heads, seqs=num_seqs, context=context, kernel_us=round(kernel_us, 1),
                  sdpa_us=round(sdpa_us, 1), speedup_vs_sdpa=round(sdpa_us / kernel_us, 2),
                  bytes=moved, gb_per_s=round(moved / kernel_us / 1e3, 1),
                  floor_us=round(moved / bandwidth * 1e6, 1), of_floor=round(moved / bandwidth * 1e6 / kernel_us, 3),
                  max_abs_error=error)
    if sweep:
        timings = {}
        for config in SWEEP:
            for splits in (1, 2, 4, 8):
                try:
                    timings[f"{config.block_m}/{config.block_n}/w{config.num_warps}/s{config.num_stages}/k{splits}"] \
                        = round(time_us(lambda c=config, k=splits: run(c, k), iters), 1)
                except Exception as error:  # noqa: BLE001 - a config that does not compile (registers) is skipped
                    timings[f"{config}/k{splits}"] = f"failed: {type(error).__name__}"
        numeric = {key: value for key, value in timings.items() if isinstance(value, float)}
        result["sweep_best"] = min(numeric, key=numeric.get) if numeric else None
        result["sweep"] = timings
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    bandwidth = copy_bandwidth(20)
    results = [run_case(name, *CASES[name], args.iters, bandwidth, args.sweep) for name in args.cases.split(",")]
    print(f"MLA decode kernel, {torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print(f"{'case':30s} {'us':>8s} {'GB/s':>8s} {'floor us':>9s} {'of floor':>9s} {'sdpa us':>8s} {'x sdpa':>7s} err")
    for r in results:
        print(f"{r['case']:30s} {r['kernel_us']:8.1f} {r['gb_per_s']:8.1f} {r['floor_us']:9.1f} {r['of_floor']:9.3f} "
              f"{r['sdpa_us']:8.1f} {r['speedup_vs_sdpa']:7.2f} {r['max_abs_error']:.1e}")
    print(json.dumps(dict(benchmark="mla_decode", date=datetime.date.today().isoformat(),
                          device=torch.cuda.get_device_name(), torch=torch.__version__,
                          copy_bytes_per_s=bandwidth, results=results)))


if __name__ == "__main__":
    main()
