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
def _row_key(seed, step):
    """sampler.noise_row_keys of one row from its int64 seed and step, in uint32 arithmetic: the torch path's int64
    arithmetic masked to 32 bits, as its _hash32 masks."""
    step_bits = step.to(tl.uint32) * 0x9E3779B1 + 0x7F4A7C15  # the low 32 bits of the int64 product and sum
    return _hash32(_hash32(seed.to(tl.uint32)) ^ _hash32(step_bits))


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
    logits_ptr, stride_row, temperatures_ptr, seeds_ptr, steps_ptr, best_score_ptr, best_index_ptr, chunk_max_ptr,
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
    row_key = _row_key(tl.load(seeds_ptr + row), tl.load(steps_ptr + row))
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


@triton.jit(do_not_specialize=["num_rows"])  # one compilation for every batch size, not one per divisibility
def _merge_chunks_kernel(
    logits_ptr, stride_row, temperatures_ptr, best_score_ptr, best_index_ptr, chunk_max_ptr, chunk_sum_ptr,
    tokens_ptr, results_ptr, num_rows, num_chunks, BLOCK_C: tl.constexpr,
):
    """Program per row: the drawn token (the best chunk's winner; the lowest chunk on a tie, as torch.argmax) and
    log_softmax(logits / T) at it from the chunks' max and sum of exp. Writes the token [rows] int64 and the
    results [2, rows] float64 (token id, log-prob) that go to the host."""
    row = tl.program_id(0)
    chunks = tl.arange(0, BLOCK_C)
    valid = chunks < num_chunks
    offsets = row * num_chunks + chunks
    scores = tl.load(best_score_ptr + offsets, mask=valid, other=float("-inf"))
    first = tl.min(tl.where(valid & (scores == tl.max(scores, 0)), chunks, BLOCK_C), 0)
    token = tl.load(best_index_ptr + row * num_chunks + first)
    maxes = tl.load(chunk_max_ptr + offsets, mask=valid, other=float("-inf"))
    sums = tl.load(chunk_sum_ptr + offsets, mask=valid, other=0.0)
    row_max = tl.max(maxes, 0)
    log_sum_exp = row_max + tl.log(tl.sum(tl.where(valid, sums * tl.exp(maxes - row_max), 0.0), 0))
    temperature = tl.load(temperatures_ptr + row)
    divisor = tl.where(temperature == 0.0, 1.0, temperature)
    token_logit = tl.load(logits_ptr + row.to(tl.int64) * stride_row + token).to(tl.float32) / divisor
    tl.store(tokens_ptr + row, token)
    tl.store(results_ptr + row, token.to(tl.float64))
    tl.store(results_ptr + num_rows + row, (token_logit - log_sum_exp).to(tl.float64))


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
    -> (token ids [rows], log-probs [rows] float32): the Gumbel-max draw on logits / T and log_softmax(logits / T)
    at the drawn token (T = 1 for greedy rows)."""
    tokens, results = fused_sample_results(logits, temperatures, seeds, steps)
    return tokens, results[1].float()


def fused_sample_results(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor,
                         steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """As fused_sample, returning (token ids [rows] int64, results [2, rows] float64: token ids, exact in float64,
    and log-probs), the results as the host copy wants them. Two launches: the vocabulary is split into chunks,
    enough programs to fill the GPU at small batches, then one program per row combines the chunks' winners and
    statistics (the torch ops that did it, and the rows' noise keys, were ~50 small kernels per decode step)."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    num_rows, vocab_size = logits.shape
    tokens = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    results = torch.empty(2, num_rows, dtype=torch.float64, device=logits.device)
    if not num_rows:
        return tokens, results
    num_chunks = min(NUM_CHUNKS, triton.cdiv(vocab_size, BLOCK_V))
    chunk_size = triton.cdiv(triton.cdiv(vocab_size, num_chunks), BLOCK_V) * BLOCK_V
    num_chunks = triton.cdiv(vocab_size, chunk_size)
    best_score, best_index, chunk_max, chunk_sum = chunk_buffers(num_rows, num_chunks, logits.device)
    temperatures = temperatures.float().contiguous()
    seeds, steps = seeds.long().contiguous(), steps.long().contiguous()
    _sample_kernel[(num_rows, num_chunks)](
        logits, logits.stride(0), temperatures, seeds, steps, best_score, best_index, chunk_max, chunk_sum,
        vocab_size, chunk_size, BLOCK_V=BLOCK_V,
    )
    _merge_chunks_kernel[(num_rows,)](
        logits, logits.stride(0), temperatures, best_score, best_index, chunk_max, chunk_sum, tokens, results,
        num_rows, num_chunks, BLOCK_C=triton.next_power_of_2(num_chunks),
    )
    return tokens, results
