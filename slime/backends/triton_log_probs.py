"""The chunked log-prob head's elementwise work as two Triton kernels, for CUDA: the matmuls stay in torch (cuBLAS),
and each chunk's logits [C, V] (in the matmul's dtype, bf16 under mixed precision) are read once in forward and
read and overwritten once in backward, instead of the ~8 fp32 passes of the torch path in `log_probs.py`.

- forward, `logits_stats`: per row, one online pass for the log-sum-exp, log p(target) and the entropy of
  softmax(logits / temperature). Only the per-row max and log-sum-exp are kept for backward, never the logits.
- backward, `logits_grad_`: recomputed logits -> d loss / d logits, in place, so no second [C, V] buffer exists.

Not the reference and not the CPU path: those stay in `log_probs.py`, which dispatches here for CUDA tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

STATS_BLOCK_V = 2048
STATS_NUM_WARPS = 8
GRAD_BLOCK_V = 2048
GRAD_NUM_WARPS = 8


@triton.jit
def _logits_stats_kernel(
    logits_ptr, target_ids_ptr, log_probs_ptr, entropy_ptr, row_max_ptr, log_sum_exp_ptr, vocab_size, stride_row,
    inv_temperature, BLOCK_V: tl.constexpr,
):
    """Program `row`. Each lane keeps its own online state over the columns it visits: running max m, s = sum
    exp(z - m) and t = sum exp(z - m) * (z - m), z = logit / temperature. Tracking t relative to m keeps the
    entropy log(s) - t / s free of the cancellation that lse - sum(p * z) has for large logits. Each update costs
    one exp: exp(-|z - m|) is exp(z - m) for a smaller z, and the rescale factor exp(m - z) for a new max."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    columns = tl.arange(0, BLOCK_V)
    valid = columns < vocab_size
    # The first block seeds every lane: a lane outside the vocabulary here stays outside it (s = 0) throughout.
    m = tl.load(row_ptr + columns, mask=valid, other=0.0).to(tl.float32) * inv_temperature
    s = tl.where(valid, 1.0, 0.0)
    t = tl.zeros([BLOCK_V], dtype=tl.float32)
    for start in range(BLOCK_V, vocab_size, BLOCK_V):
        valid = start + columns < vocab_size
        z = tl.load(row_ptr + start + columns, mask=valid, other=0.0).to(tl.float32) * inv_temperature
        delta = z - m
        decay = tl.exp(-tl.abs(delta))
        is_new_max = delta > 0
        # delta <= 0: s += exp(delta), t += exp(delta) * delta.  delta > 0: rescale (s, t) to the new max z,
        # whose own term is exp(0) * 0 = 0 in t.
        new_s = tl.where(is_new_max, s * decay + 1.0, s + decay)
        new_t = tl.where(is_new_max, decay * (t - delta * s), t + decay * delta)
        s = tl.where(valid, new_s, s)
        t = tl.where(valid, new_t, t)
        m = tl.where(valid & is_new_max, z, m)
    # Merge the lanes at the row max; lanes that never saw a column (s = 0) carry no weight.
    row_max = tl.max(tl.where(s > 0, m, float("-inf")), 0)
    weight = tl.where(s > 0, tl.exp(m - row_max), 0.0)
    sum_exp = tl.sum(weight * s, 0)
    sum_exp_times_shifted_z = tl.sum(tl.where(s > 0, weight * (t + (m - row_max) * s), 0.0), 0)
    log_sum_exp = tl.log(sum_exp)
    target = tl.load(target_ids_ptr + row)
    target_z = tl.load(row_ptr + target).to(tl.float32) * inv_temperature
    # (z - max) - log_sum_exp, as log_softmax: z - (max + log_sum_exp) would round the sum to the ulp of |z|, which
    # for peaked rows is far larger than log p of the argmax.
    tl.store(log_probs_ptr + row, (target_z - row_max) - log_sum_exp)
    tl.store(entropy_ptr + row, log_sum_exp - sum_exp_times_shifted_z / sum_exp)
    tl.store(row_max_ptr + row, row_max)
    tl.store(log_sum_exp_ptr + row, log_sum_exp)


@triton.jit
def _logits_grad_kernel(
    logits_ptr, target_ids_ptr, row_max_ptr, log_sum_exp_ptr, entropy_ptr, grad_log_probs_ptr, grad_entropy_ptr,
    vocab_size, stride_row, inv_temperature,
    HAS_GRAD_LOG_PROBS: tl.constexpr, HAS_GRAD_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Program (row, column block): d loss / d logit = (g_lp * (onehot(target) - p) - g_ent * p * (log p + H)) / T,
    p = exp(z - max - log_sum_exp), written over the logits."""
    row = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    valid = columns < vocab_size
    pointers = logits_ptr + row * stride_row + columns
    z = tl.load(pointers, mask=valid, other=0.0).to(tl.float32) * inv_temperature
    log_p = (z - tl.load(row_max_ptr + row)) - tl.load(log_sum_exp_ptr + row)
    p = tl.exp(log_p)
    grad = tl.zeros([BLOCK_V], dtype=tl.float32)
    if HAS_GRAD_LOG_PROBS:
        target = tl.load(target_ids_ptr + row)
        grad += tl.load(grad_log_probs_ptr + row) * (tl.where(columns == target, 1.0, 0.0) - p)
    if HAS_GRAD_ENTROPY:
        grad -= tl.load(grad_entropy_ptr + row) * p * (log_p + tl.load(entropy_ptr + row))
    tl.store(pointers, (grad * inv_temperature).to(logits_ptr.dtype.element_ty), mask=valid)


def logits_stats(logits: torch.Tensor, target_ids: torch.Tensor, temperature: float):
    """logits [C, V] (any float dtype, unit column stride), target_ids [C] -> fp32 [C] each: log p(target),
    entropy, and the row max and log sum exp(z - max) of z = logits / temperature (their sum is the log-sum-exp)."""
    num_rows, vocab_size = logits.shape
    assert logits.stride(1) == 1
    log_probs, entropy, row_max, log_sum_exp = (
        torch.empty(num_rows, dtype=torch.float32, device=logits.device) for _ in range(4)
    )
    if num_rows:
        _logits_stats_kernel[(num_rows,)](
            logits, target_ids.contiguous(), log_probs, entropy, row_max, log_sum_exp, vocab_size, logits.stride(0),
            1.0 / temperature, BLOCK_V=STATS_BLOCK_V, num_warps=STATS_NUM_WARPS,
        )
    return log_probs, entropy, row_max, log_sum_exp


def logits_grad_(logits: torch.Tensor, target_ids: torch.Tensor, row_max: torch.Tensor, log_sum_exp: torch.Tensor,
                 entropy: torch.Tensor, grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None,
                 temperature: float):
    """Overwrites logits [C, V] with d loss / d logits (same dtype), given `logits_stats`' row max, log_sum_exp and
    entropy [C] (fp32) and the upstream gradients of log-probs and entropy [C] (None: that output is not in the
    loss)."""
    num_rows, vocab_size = logits.shape
    assert logits.stride(1) == 1
    if num_rows == 0 or (grad_log_probs is None and grad_entropy is None):
        return logits.zero_()
    # An absent gradient's pointer is never read (the constexpr flag compiles its branch out).
    grad_log_probs_arg = entropy if grad_log_probs is None else grad_log_probs.float().contiguous()
    grad_entropy_arg = entropy if grad_entropy is None else grad_entropy.float().contiguous()
    _logits_grad_kernel[(num_rows, triton.cdiv(vocab_size, GRAD_BLOCK_V))](
        logits, target_ids.contiguous(), row_max, log_sum_exp, entropy, grad_log_probs_arg, grad_entropy_arg,
        vocab_size, logits.stride(0), 1.0 / temperature,
        HAS_GRAD_LOG_PROBS=grad_log_probs is not None, HAS_GRAD_ENTROPY=grad_entropy is not None,
        BLOCK_V=GRAD_BLOCK_V, num_warps=GRAD_NUM_WARPS,
    )
    return logits


class FusedChunkedLogProbs(torch.autograd.Function):
    """Same contract as `log_probs._ChunkedLogProbs`: (hidden [N, H], weight [V, H], target_ids [N], temperature,
    chunk_size) -> fp32 log-probs and entropy [N]."""

    @staticmethod
    def forward(ctx, hidden, weight, target_ids, temperature, chunk_size):
        ctx.set_materialize_grads(False)
        num_tokens = hidden.shape[0]
        log_probs = torch.empty(num_tokens, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(log_probs)
        row_max, log_sum_exp = torch.empty_like(log_probs), torch.empty_like(log_probs)
        for start in range(0, num_tokens, chunk_size):
            end = min(start + chunk_size, num_tokens)
            logits = hidden[start:end] @ weight.t()
            log_probs[start:end], entropy[start:end], row_max[start:end], log_sum_exp[start:end] = logits_stats(
                logits, target_ids[start:end], temperature
            )
            del logits  # free before the next chunk's matmul allocates its own
        ctx.save_for_backward(hidden, weight, target_ids, row_max, log_sum_exp, entropy)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        hidden, weight, target_ids, row_max, log_sum_exp, entropy = ctx.saved_tensors
        num_tokens, chunk_size = hidden.shape[0], ctx.chunk_size
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = None
        num_chunks = triton.cdiv(num_tokens, chunk_size)
        if ctx.needs_input_grad[1] and num_chunks != 1:
            grad_weight = torch.zeros_like(weight, dtype=torch.float32)
        for start in range(0, num_tokens, chunk_size):
            end = min(start + chunk_size, num_tokens)
            chunk_hidden = hidden[start:end]
            grad_logits = logits_grad_(
                chunk_hidden @ weight.t(), target_ids[start:end],
                row_max[start:end], log_sum_exp[start:end], entropy[start:end],
                None if grad_log_probs is None else grad_log_probs[start:end],
                None if grad_entropy is None else grad_entropy[start:end],
                ctx.temperature,
            )
            if grad_hidden is not None:
                torch.mm(grad_logits, weight, out=grad_hidden[start:end])
            if ctx.needs_input_grad[1]:
                chunk_grad_weight = grad_logits.t() @ chunk_hidden
                if num_chunks == 1:  # one chunk: fp32 accumulation then the cast back would be the identity
                    grad_weight = chunk_grad_weight
                else:
                    grad_weight.add_(chunk_grad_weight)
                del chunk_grad_weight
            del grad_logits
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None
