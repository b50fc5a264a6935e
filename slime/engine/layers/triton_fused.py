"""Triton kernels that fuse the decoder's small elementwise stages, each into one launch: RMSNorm over the last dim,
the residual add fused with the RMSNorm after it, per-head q/k RMSNorm followed by rotary embedding, and
SiLU-and-multiply, and the attention's input stage (q/k norm, rotary, and the K/V cache writes) in one launch.
Rotary covers the whole head rotate-half (Llama / Qwen) and, from the table's width and `interleaved`, the partial
variants of the GLM families: only the first `rotary_dim` dims rotate, as rotate-half pairs (GLM-4.5) or as adjacent
pairs (GLM-4); each output dim then reads its pair partner again from memory (normed the same way), the others pass.

Why: at decode batch sizes every layer is dozens of tiny kernels (RMSNorm alone is seven torch ops), and even
inside a CUDA graph each costs a few microseconds of GPU time; fused, a layer is about a dozen launches. Each kernel
rounds where the torch modules round (normalize in float32, cast to the model dtype, then scale by the weight), so
both paths agree to the last bit or within one rounding. The torch modules in `rmsnorm.py`, `rotary.py` and
`activation.py` stay the reference and the CPU path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slime.engine.dtypes import FP8_DTYPES


@triton.jit
def _rms_norm_kernel(x_ptr, weight_ptr, out_ptr, stride_x, stride_out, num_columns, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, BLOCK)
    valid = columns < num_columns
    x = tl.load(x_ptr + row * stride_x + columns, mask=valid, other=0.0).to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, 0) / num_columns + eps)
    weight = tl.load(weight_ptr + columns, mask=valid, other=0.0)
    out = weight * normed.to(weight.dtype)
    tl.store(out_ptr + row * stride_out + columns, out.to(out_ptr.dtype.element_ty), mask=valid)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of a [..., hidden] tensor whose rows are contiguous."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.result_type(weight, x), device=x.device)
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](
            x, weight, out, x.stride(0), out.stride(0), shape[-1], eps, BLOCK=triton.next_power_of_2(shape[-1])
        )
    return out.view(shape)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_residual,
    stride_out,
    stride_residual_out,
    num_columns,
    eps,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, BLOCK)
    valid = columns < num_columns
    x = tl.load(x_ptr + row * stride_x + columns, mask=valid, other=0.0)
    residual = tl.load(residual_ptr + row * stride_residual + columns, mask=valid, other=0.0)
    # Rounded to the model dtype before the norm reads it back, as torch's `x + residual` then RMSNorm.
    summed = (x.to(tl.float32) + residual.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
    tl.store(residual_out_ptr + row * stride_residual_out + columns, summed, mask=valid)
    summed = summed.to(tl.float32)
    normed = summed * tl.rsqrt(tl.sum(summed * summed, 0) / num_columns + eps)
    weight = tl.load(weight_ptr + columns, mask=valid, other=0.0)
    out = weight * normed.to(weight.dtype)
    tl.store(out_ptr + row * stride_out + columns, out.to(out_ptr.dtype.element_ty), mask=valid)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual) of [num_tokens, hidden] tensors with contiguous rows, in one launch:
    the decoder's residual add fused with the norm that follows it."""
    assert x.shape == residual.shape and x.dim() == 2, "add_rms_norm expects two [num_tokens, hidden] tensors"
    if x.stride(-1) != 1:
        x = x.contiguous()
    if residual.stride(-1) != 1:
        residual = residual.contiguous()
    residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out = torch.empty(x.shape, dtype=torch.result_type(weight, x), device=x.device)
    if x.shape[0]:
        _add_rms_norm_kernel[(x.shape[0],)](
            x, residual, weight, out, residual_out, x.stride(0), residual.stride(0), out.stride(0),
            residual_out.stride(0), x.shape[1], eps, BLOCK=triton.next_power_of_2(x.shape[1]),
        )  # fmt: skip
    return out, residual_out


@triton.jit
def _norm_rope_heads(x_ptr, x_row, stride_x_head, out_ptr, out_row, stride_out_head, weight_ptr, cos, sin, num_heads,
                     eps, cos_ptr, sin_ptr, table_row, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                     HAS_NORM: tl.constexpr, LIMIT: tl.constexpr, ROT_HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """One token's heads: optional per-head RMSNorm, then rotary with this position's cos / sin [1, HALF] (whole-head
    rotate-half), or, for partial / interleaved RoPE, with the table row at `table_row` read per dim; rounded to
    x's dtype and stored in out's; LIMIT > 0 (an fp8 out) clamps to +-LIMIT before that store."""
    heads = tl.arange(0, BLOCK_H)
    half = tl.arange(0, HALF)
    valid = (heads < num_heads)[:, None]
    x_offsets = x_row + heads[:, None] * stride_x_head + half[None, :]
    x1 = tl.load(x_ptr + x_offsets, mask=valid, other=0.0)
    x2 = tl.load(x_ptr + x_offsets + HALF, mask=valid, other=0.0)
    dtype = x1.dtype
    inv_rms = tl.zeros([BLOCK_H], dtype=tl.float32)
    if HAS_NORM:
        x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
        inv_rms = tl.rsqrt((tl.sum(x1f * x1f, 1) + tl.sum(x2f * x2f, 1)) / (2 * HALF) + eps)
        w1 = tl.load(weight_ptr + half)
        w2 = tl.load(weight_ptr + HALF + half)
        x1 = (w1[None, :] * (x1f * inv_rms[:, None]).to(dtype)).to(dtype)
        x2 = (w2[None, :] * (x2f * inv_rms[:, None]).to(dtype)).to(dtype)
    out_offsets = out_row + heads[:, None] * stride_out_head + half[None, :]
    if ROT_HALF == HALF and not INTERLEAVED:
        x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
        out1, out2 = x1f * cos - x2f * sin, x2f * cos + x1f * sin
    else:
        x_head = x_row + heads[:, None] * stride_x_head
        out1 = _partial_rotation(x_ptr, x_head, valid, x1, half, weight_ptr, inv_rms, cos_ptr, sin_ptr, table_row,
                                 HAS_NORM, ROT_HALF, INTERLEAVED)
        out2 = _partial_rotation(x_ptr, x_head, valid, x2, half + HALF, weight_ptr, inv_rms, cos_ptr, sin_ptr,
                                 table_row, HAS_NORM, ROT_HALF, INTERLEAVED)
    tl.store(out_ptr + out_offsets, _saturate(out1.to(dtype), LIMIT, out_ptr), mask=valid)
    tl.store(out_ptr + out_offsets + HALF, _saturate(out2.to(dtype), LIMIT, out_ptr), mask=valid)


@triton.jit
def _partial_rotation(x_ptr, x_head, valid, own, dims, weight_ptr, inv_rms, cos_ptr, sin_ptr, table_row,
                      HAS_NORM: tl.constexpr, ROT_HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """float32 rotary of `own` [BLOCK_H, n] (the heads' normed values at head dims `dims` [n]) when only dims below
    2 * ROT_HALF rotate: each with its pair partner (d ^ 1 interleaved, d +- ROT_HALF rotate-half), read from x again
    and normed like `own`; cos / sin from the table row (as wide as the rotary dims); the other dims pass."""
    rotating = dims < 2 * ROT_HALF
    if INTERLEAVED:
        partner = tl.where(rotating, dims ^ 1, dims)
        sign = tl.where(dims % 2 == 0, -1.0, 1.0)
    else:
        partner = tl.where(dims < ROT_HALF, dims + ROT_HALF, tl.where(rotating, dims - ROT_HALF, dims))
        sign = tl.where(dims < ROT_HALF, -1.0, 1.0)
    other = tl.load(x_ptr + x_head + partner[None, :], mask=valid, other=0.0)
    if HAS_NORM:
        weight = tl.load(weight_ptr + partner)
        other = (weight[None, :] * (other.to(tl.float32) * inv_rms[:, None]).to(other.dtype)).to(other.dtype)
    cos = tl.load(cos_ptr + table_row + dims, mask=rotating, other=1.0)[None, :]
    sin = tl.load(sin_ptr + table_row + dims, mask=rotating, other=0.0)[None, :]
    return own.to(tl.float32) * cos + (sign[None, :] * other.to(tl.float32)) * sin


@triton.jit
def _saturate(x, LIMIT: tl.constexpr, out_ptr):
    """x in out_ptr's dtype; with LIMIT > 0 clamped to +-LIMIT first (fp8 has no room for larger values)."""
    if LIMIT > 0:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -LIMIT), LIMIT)
    return x.to(out_ptr.dtype.element_ty)


@triton.jit
def _rotary_of(cos_ptr, sin_ptr, table_row, HALF: tl.constexpr, FULL: tl.constexpr):
    """This token's cos / sin [1, HALF] of a whole-head rotate-half table (`FULL`): the table repeats each frequency
    in both halves (HF layout), so the first half's entries serve both. Partial tables are read per dim later
    (`_partial_rotation`): zeros here."""
    half = tl.arange(0, HALF)
    if FULL:
        cos = tl.load(cos_ptr + table_row + half)[None, :]
        sin = tl.load(sin_ptr + table_row + half)[None, :]
    else:
        cos = tl.zeros([1, HALF], dtype=tl.float32)
        sin = tl.zeros([1, HALF], dtype=tl.float32)
    return cos, sin


@triton.jit
def _norm_rope_kernel(
    x_ptr,
    out_ptr,
    weight_ptr,
    cos_ptr,
    sin_ptr,
    positions_ptr,
    stride_x_token,
    stride_x_head,
    stride_out_token,
    stride_out_head,
    stride_table,
    num_heads,
    eps,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_NORM: tl.constexpr,
    ROT_HALF: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    table_row = tl.load(positions_ptr + token).to(tl.int64) * stride_table
    cos, sin = _rotary_of(cos_ptr, sin_ptr, table_row, HALF, ROT_HALF == HALF and not INTERLEAVED)
    _norm_rope_heads(x_ptr, token * stride_x_token, stride_x_head, out_ptr, token * stride_out_token,
                     stride_out_head, weight_ptr, cos, sin, num_heads, eps, cos_ptr, sin_ptr, table_row, HALF,
                     BLOCK_H, HAS_NORM, 0.0, ROT_HALF, INTERLEAVED)


@triton.jit
def _qkv_rope_store_kernel(
    qkv_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr,
    positions_ptr, stride_qkv_token, stride_table, num_heads, num_kv_heads, eps,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, HAS_NORM: tl.constexpr,
    CACHE_LIMIT: tl.constexpr, ROT_HALF: tl.constexpr, INTERLEAVED: tl.constexpr,
):
    """Program per token: q heads normed and rotated into q_out [tokens, heads, dim]; k heads normed, rotated and
    written to the flat K cache at the token's slot; v heads copied to the V cache at that slot."""
    token = tl.program_id(0).to(tl.int64)
    table_row = tl.load(positions_ptr + token).to(tl.int64) * stride_table
    cos, sin = _rotary_of(cos_ptr, sin_ptr, table_row, HALF, ROT_HALF == HALF and not INTERLEAVED)
    slot_row = tl.load(slot_mapping_ptr + token).to(tl.int64) * num_kv_heads * (2 * HALF)
    qkv_row = token * stride_qkv_token
    _norm_rope_heads(qkv_ptr, qkv_row, 2 * HALF, q_out_ptr, token * num_heads * (2 * HALF), 2 * HALF, q_weight_ptr,
                     cos, sin, num_heads, eps, cos_ptr, sin_ptr, table_row, HALF, BLOCK_H, HAS_NORM, 0.0, ROT_HALF,
                     INTERLEAVED)
    _norm_rope_heads(qkv_ptr, qkv_row + num_heads * (2 * HALF), 2 * HALF, k_cache_ptr, slot_row, 2 * HALF,
                     k_weight_ptr, cos, sin, num_kv_heads, eps, cos_ptr, sin_ptr, table_row, HALF, BLOCK_KV,
                     HAS_NORM, CACHE_LIMIT, ROT_HALF, INTERLEAVED)
    heads = tl.arange(0, BLOCK_KV)[:, None]
    dims = tl.arange(0, 2 * HALF)[None, :]
    valid = heads < num_kv_heads
    v = tl.load(qkv_ptr + qkv_row + (num_heads + num_kv_heads) * (2 * HALF) + heads * (2 * HALF) + dims, mask=valid)
    tl.store(v_cache_ptr + slot_row + heads * (2 * HALF) + dims, _saturate(v, CACHE_LIMIT, v_cache_ptr), mask=valid)


def qkv_rope_store(
    qkv: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    q_out: torch.Tensor | None = None,
    interleaved: bool = False,
) -> torch.Tensor:
    """The attention's input stage in one launch: qkv [num_tokens, (heads + 2 kv_heads) * head_dim] -> q
    [num_tokens, heads, head_dim] after optional per-head RMSNorm and rotary; k (likewise) and v are written into
    the caches [blocks, block_size, kv_heads, head_dim] at `slot_mapping` (into an fp8 cache rounded from qkv's
    dtype by the store, which saturates as `dtypes.to_cache_dtype`). Equals norm_rope on q and k followed by the
    caches' index_copy_, in three launches fewer per layer. q is written into `q_out` (contiguous) when given.
    cos / sin [max_position, rotary_dim]: rotary_dim < head_dim rotates the first dims only; `interleaved` takes
    adjacent pairs (rotary.py's layouts)."""
    num_tokens = qkv.shape[0]
    num_kv_heads, head_dim = k_cache.shape[-2:]
    assert qkv.stride(-1) == 1 and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == v_cache.dtype
    assert k_cache.dtype == qkv.dtype or k_cache.dtype in FP8_DTYPES, "the cache is in qkv's dtype or an fp8 one"
    assert cos.is_contiguous() and sin.is_contiguous() and (q_weight is None) == (k_weight is None)
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device) if q_out is None else q_out
    assert q.shape == (num_tokens, num_heads, head_dim) and q.dtype == qkv.dtype and q.is_contiguous()
    if num_tokens:
        _qkv_rope_store_kernel[(num_tokens,)](
            qkv, q, k_cache, v_cache, slot_mapping,
            q_weight if q_weight is not None else qkv, k_weight if k_weight is not None else qkv,
            cos, sin, positions, qkv.stride(0), cos.stride(0), num_heads, num_kv_heads, eps,
            HALF=head_dim // 2, BLOCK_H=triton.next_power_of_2(num_heads),
            BLOCK_KV=triton.next_power_of_2(num_kv_heads), HAS_NORM=q_weight is not None,
            CACHE_LIMIT=float(torch.finfo(k_cache.dtype).max) if k_cache.dtype in FP8_DTYPES else 0.0,
            ROT_HALF=_rot_half(cos, head_dim), INTERLEAVED=interleaved,
        )
    return q


def _rot_half(cos: torch.Tensor, head_dim: int) -> int:
    """Half the rotary dims: the table's width (rotary.py builds it rotary_dim wide)."""
    assert cos.shape[1] % 2 == 0 and cos.shape[1] <= head_dim, "the rotary table is at most head_dim wide"
    return cos.shape[1] // 2


def norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    interleaved: bool = False,
) -> torch.Tensor:
    """x [num_tokens, num_heads, head_dim] (a strided view is fine) -> contiguous result of optional per-head
    RMSNorm (weight [head_dim]) then rotary embedding at `positions`; cos / sin [max_position, rotary_dim] float32
    (rotary_dim < head_dim: partial RoPE; `interleaved`: adjacent pairs).
    The decoder runs `qkv_rope_store` (the same arithmetic plus the cache writes); this one-tensor form is its
    tested building block and the tests' reference for it."""
    num_tokens, num_heads, head_dim = x.shape
    assert x.stride(-1) == 1 and cos.is_contiguous() and sin.is_contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_tokens:
        _norm_rope_kernel[(num_tokens,)](
            x,
            out,
            weight if weight is not None else x,
            cos,
            sin,
            positions,
            x.stride(0),
            x.stride(1),
            out.stride(0),
            out.stride(1),
            cos.stride(0),
            num_heads,
            eps,
            HALF=head_dim // 2,
            BLOCK_H=triton.next_power_of_2(num_heads),
            HAS_NORM=weight is not None,
            ROT_HALF=_rot_half(cos, head_dim),
            INTERLEAVED=interleaved,
        )
    return out


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, num_columns, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = columns < num_columns
    gate = tl.load(gate_up_ptr + row * stride_in + columns, mask=valid, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + num_columns + columns, mask=valid, other=0.0)
    gate_f = gate.to(tl.float32)
    activated = (gate_f / (1.0 + tl.exp(-gate_f))).to(gate.dtype)
    tl.store(out_ptr + row * stride_out + columns, (activated * up).to(gate.dtype), mask=valid)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[num_tokens, 2 * n] -> silu(first half) * second half, [num_tokens, n]."""
    num_tokens, width = gate_up.shape
    assert gate_up.stride(-1) == 1
    out = torch.empty(num_tokens, width // 2, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    if num_tokens:
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(width // 2, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), width // 2, BLOCK=block
        )
    return out
