"""The sampler's CUDA fast path: one pass of one Triton kernel over the logits (bf16 straight from the LM head)
that scales by temperature, draws the Gumbel-max sample with noise hashed in registers from (seed, step, column),
and gathers the statistics of log_softmax, so that neither float32 logits, probabilities nor noise are ever
materialised as [rows, vocab] tensors. The torch path in `sampler.py` runs several full passes instead.

Noise: g = -log(-log(u)) with u = (hash + 0.5) / 2**32, the same hash as `sampler.gumbel_noise`, computed here in
float32 (the torch path uses float64): -log(u) through log1p(-(1 - u)) when u >= 1/2, so the noise of u near 1 (the
large g that win the draw) keeps its precision. The two paths pick the same token except where the two best scores
of a row lie within float32 rounding of each other. Ties go to the lowest index, as torch.argmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 1024
NUM_CHUNKS = 16


@triton.jit
def _hash32(x):
    # uint32 wrap-around arithmetic equals sampler._hash32's int64 arithmetic masked to 32 bits.
    x = ((x >> 16) ^ x) * 0x45D9F3B
    x = ((x >> 16) ^ x) * 0x45D9F3B
    return (x >> 16) ^ x


@triton.jit
def _gumbel(bits):
    """-log(-log(u)), u = (bits + 0.5) / 2**32, from uint32 bits, in float32."""
    u = (bits.to(tl.float32) + 0.5) * 2.3283064365386963e-10
    v = ((~bits).to(tl.float32) + 0.5) * 2.3283064365386963e-10  # 1 - u, accurate where u is near 1
    w = 1.0 - v
    low = bits < 2147483648
    log_arg = tl.log(tl.where(low, u, w))
    # log1p(-v) from log(1 - v), corrected for the rounding of 1 - v (exact where 1 - v rounds to 1).
    log1p_neg_v = tl.where(w == 1.0, -v, log_arg * (-v / (w - 1.0)))
    return -tl.log(-tl.where(low, log_arg, log1p_neg_v))


@triton.jit
def _sample_kernel(
    logits_ptr, stride_row, temperatures_ptr, row_keys_ptr, best_score_ptr, best_index_ptr, chunk_max_ptr,
    chunk_sum_ptr, vocab_size, chunk_size, BLOCK_V: tl.constexpr,
):
    """Program (row, chunk) over columns [chunk * chunk_size, + chunk_size): the best score logits/T + g (logits for
    a greedy row, T = 0) with its lowest index, and the max and sum of exp(logits/T - max) for the log-sum-exp."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    num_chunks = tl.num_programs(1)
    temperature = tl.load(temperatures_ptr + row)
    greedy = temperature == 0.0
    divisor = tl.where(greedy, 1.0, temperature)
    row_key = tl.load(row_keys_ptr + row).to(tl.uint32)
    best_score = tl.full([BLOCK_V], float("-inf"), dtype=tl.float32)
    best_index = tl.zeros([BLOCK_V], dtype=tl.int32)
    run_max = tl.full([BLOCK_V], float("-inf"), dtype=tl.float32)
    run_sum = tl.zeros([BLOCK_V], dtype=tl.float32)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    chunk_start = chunk * chunk_size
    chunk_end = tl.minimum(chunk_start + chunk_size, vocab_size)
    for start in range(chunk_start, chunk_end, BLOCK_V):
        columns = start + tl.arange(0, BLOCK_V)
        valid = columns < chunk_end
        scaled = tl.load(row_ptr + columns, mask=valid, other=float("-inf")).to(tl.float32) / divisor
        new_max = tl.maximum(run_max, scaled)
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # no inf - inf while a lane has seen only -inf
        run_sum = run_sum * tl.exp(run_max - shift) + tl.exp(scaled - shift)
        run_max = new_max
        noise = _gumbel(_hash32(_hash32(row_key ^ columns.to(tl.uint32)) + row_key))
        score = tl.where(greedy, scaled, scaled + noise)
        better = score > best_score  # strict: an earlier column keeps a tie
        best_score = tl.where(better, score, best_score)
        best_index = tl.where(better, columns, best_index)
    top = tl.max(best_score, 0)
    index = tl.min(tl.where(best_score == top, best_index, vocab_size), 0)
    chunk_max = tl.max(run_max, 0)
    shift = tl.where(chunk_max == float("-inf"), 0.0, chunk_max)
    chunk_sum = tl.sum(run_sum * tl.exp(run_max - shift), 0)
    out = row * num_chunks + chunk
    tl.store(best_score_ptr + out, top)
    tl.store(best_index_ptr + out, tl.minimum(index, vocab_size - 1).to(tl.int64))
    tl.store(chunk_max_ptr + out, chunk_max)
    tl.store(chunk_sum_ptr + out, chunk_sum)


def chunk_buffers(num_rows: int, num_chunks: int, device) -> tuple[torch.Tensor, ...]:
    """The kernel's per-chunk outputs [rows, chunks]: best score, its index, max and sum of exp. Each is its own
    allocation, so each starts aligned: Triton compiles a kernel per pointer alignment, and views into one shared
    buffer would start at offsets that depend on the row count (measured on an H200: a new batch size mid-run
    compiled the kernel again, a 300 ms step)."""
    shape = (num_rows, num_chunks)
    return (torch.empty(shape, dtype=torch.float32, device=device), torch.empty(shape, dtype=torch.int64, device=device),
            torch.empty(shape, dtype=torch.float32, device=device), torch.empty(shape, dtype=torch.float32, device=device))


def fused_sample(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor,
                 steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [rows, vocab] (any float dtype), temperatures [rows] float32 (0 = greedy), seeds / steps [rows] int64
    -> (token ids [rows], log-probs [rows]): the Gumbel-max draw on logits / T and log_softmax(logits / T) at the
    drawn token (T = 1 for greedy rows). The vocabulary is split into chunks, enough programs to fill the GPU at
    small batches; per-chunk winners and statistics are combined with a few [rows, chunks] torch ops."""
    from slime.engine.sampler import noise_row_keys, temperature_divisors

    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    num_rows, vocab_size = logits.shape
    if not num_rows:
        empty = torch.empty(0, device=logits.device)
        return empty.long(), empty.float()
    num_chunks = min(NUM_CHUNKS, triton.cdiv(vocab_size, BLOCK_V))
    chunk_size = triton.cdiv(triton.cdiv(vocab_size, num_chunks), BLOCK_V) * BLOCK_V
    num_chunks = triton.cdiv(vocab_size, chunk_size)
    best_score, best_index, chunk_max, chunk_sum = chunk_buffers(num_rows, num_chunks, logits.device)
    temperatures = temperatures.float().contiguous()
    row_keys = noise_row_keys(seeds, steps).contiguous()
    _sample_kernel[(num_rows, num_chunks)](
        logits, logits.stride(0), temperatures, row_keys, best_score, best_index, chunk_max, chunk_sum,
        vocab_size, chunk_size, BLOCK_V=BLOCK_V,
    )
    tokens = best_index.gather(1, best_score.argmax(1, keepdim=True)).squeeze(1)
    row_max = chunk_max.max(1, keepdim=True).values
    log_sum_exp = row_max.squeeze(1) + (chunk_sum * torch.exp(chunk_max - row_max)).sum(1).log()
    token_logits = logits.gather(1, tokens[:, None]).squeeze(1).float() / temperature_divisors(temperatures)
    return tokens, token_logits - log_sum_exp
