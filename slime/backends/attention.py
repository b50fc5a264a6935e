"""Attention over packed micro-batches: causal within each sample of a packed row, never across samples, and no
[T, T] mask over the whole row (sdpa with restarting position_ids builds a dense block-diagonal one: quadratic
memory and time in the packed length). Registered with transformers as the attention implementation `slime_varlen`.

A packed row holds several samples back to back; `cu_seqlens` ([num_samples + 1], int32, cumulative lengths) marks
where each starts. The model's forward passes `cu_seq_lens_q` / `max_length_q` (transformers' FlashAttention
keyword names), and transformers hands them through every decoder layer to `varlen_attention_forward`.

`packed_causal_attention` picks the kernel, for this backend and Megatron's (megatron_utils/attention.py):
- GPU with FlashAttention: torch's built-in varlen kernel (`aten._flash_attention_forward` / `_backward`), wrapped
  here as a custom op with its own backward rather than through `torch.nn.attention.varlen.varlen_attn`: that
  wrapper only takes grouped-query attention from torch 2.12 on, and repeating K/V to the query heads (the way
  around it) costs a copy of K and V per layer in forward, their reduction in backward, and the repeated copies
  kept for backward (about 7 GB of activations for Qwen3-4B at 16k-token micro-batches). The kernel reads grouped
  K/V itself.
- Elsewhere (the CPU): sdpa over the samples grouped by length (power-of-two buckets), each group right-padded to
  its longest sample and run as one causal batch. Exact: under the causal mask a real query sees only its own
  sample's earlier keys, never the padding after it, and the padded rows' outputs are dropped (so their gradients
  are zero). Attention work is at most 4x the samples' own (a sample of length L in bucket (M/2, M] pads to <= M),
  against (sum L)^2 for the dense mask; on the quickstart's 36-token samples packed 1,100 to a row that is ~30x less.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

VARLEN = "slime_varlen"


def varlen_supported(device: torch.device, dtype: torch.dtype | None = None) -> bool:
    """CUDA, a torch built with FlashAttention, and a GPU it runs on (Ampere or newer); with `dtype`, also one
    FlashAttention takes (fp16 or bf16: an fp32 model runs the sdpa path)."""
    if dtype is not None and dtype not in (torch.float16, torch.bfloat16):
        return False
    return (device.type == "cuda" and torch.backends.cuda.is_flash_attention_available()
            and hasattr(torch.ops.aten, "_flash_attention_backward")
            and torch.cuda.get_device_capability(device) >= (8, 0))


def varlen_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, *,
                             cu_seq_lens_q=None, max_length_q=None, **kwargs):
    """transformers attention-interface signature: query [1, Hq, T, D], key/value [1, Hkv, T, D]; returns
    ([1, T, Hq, D], None)."""
    if cu_seq_lens_q is None or max_length_q is None:
        raise ValueError(f"attention implementation {VARLEN!r} needs cu_seq_lens_q and max_length_q (packed "
                         "micro-batches from slime's trainer); load the model with attn_implementation='sdpa' "
                         "for other uses")
    if query.shape[0] != 1:
        raise ValueError(f"{VARLEN!r} takes one packed row, got a batch of {query.shape[0]}")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    return packed_causal_attention(q, k, v, cu_seq_lens_q, int(max_length_q), scale).unsqueeze(0), None


def packed_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                            max_seqlen: int, scale: float) -> torch.Tensor:
    """Causal attention within each packed sample: q/k [T, Hq or Hkv, D], v [T, Hkv, Dv] (Hq a multiple of Hkv;
    Dv may differ from D, as in multi-head latent attention: 192 vs 128 for DeepSeek-V3) -> [T, Hq, Dv].
    FlashAttention's varlen kernel where it runs, else length-bucketed padded sdpa (module docstring)."""
    if varlen_supported(q.device, q.dtype):
        value_dim = v.shape[-1]
        if value_dim != q.shape[-1]:  # one head dim for q, k and v in FlashAttention: zero columns change nothing
            width = max(value_dim, q.shape[-1])
            q, k, v = (F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))  # the scale stays the caller's
        out = flash_varlen_causal(q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens, max_seqlen, scale)[0]
        return out[..., :value_dim]
    return bucketed_causal_attention(q, k, v, cu_seqlens, scale)


@torch.compiler.disable  # data-dependent shapes: under --compile-model it runs eager (tracing it recompiled per row)
def bucketed_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                              scale: float) -> torch.Tensor:
    """The non-flash path of `packed_causal_attention`: samples with lengths in (M/2, M] share one sdpa call,
    right-padded to their longest (padding gathers the sample's own last token: never seen by a real query)."""
    bounds = cu_seqlens.tolist()
    starts, ends = bounds[:-1], bounds[1:]
    buckets: dict[int, list[int]] = {}
    for sample, (start, end) in enumerate(zip(starts, ends)):
        buckets.setdefault((end - start - 1).bit_length(), []).append(sample)
    outputs, order = [], []
    for samples in buckets.values():
        lengths = torch.tensor([ends[i] - starts[i] for i in samples])
        longest = int(lengths.max())
        offsets = torch.arange(longest)
        positions = torch.tensor([starts[i] for i in samples])[:, None] + torch.minimum(offsets, lengths[:, None] - 1)
        positions = positions.to(q.device)
        padded = [t[positions].transpose(1, 2) for t in (q, k, v)]  # [B, H, longest, D]
        out = F.scaled_dot_product_attention(*padded, is_causal=True, scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
        real = (offsets[None, :] < lengths[:, None]).flatten().nonzero().squeeze(1).to(q.device)
        outputs.append(out.transpose(1, 2).reshape(-1, out.shape[1], out.shape[3])[real])  # [real tokens, H, Dv]
        order.append(positions.flatten()[real])
    # rows come in bucket order; the inverse permutation of their packed positions puts them back
    return torch.cat(outputs).index_select(0, torch.argsort(torch.cat(order)))


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
             scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    out, log_sum_exp, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, 0.0, True, False, scale=scale)
    return out, log_sum_exp


def _backward_kernel(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     log_sum_exp: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # No dropout, so the kernel never reads the random-number state (torch's own wrapper passes the same).
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)
    unused = torch.empty(0, device=q.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        grad_out.contiguous(), q, k, v, out, log_sum_exp, cu_seqlens, cu_seqlens, max_len, max_len, 0.0, True,
        rng_state, unused, scale=scale)
    return dq, dk, dv


# Custom ops, so that torch.compile treats the kernels as opaque calls; the same functions serve as their fake
# (tracing) implementations, where the aten ops answer with torch's own meta shapes.
flash_varlen_causal = torch.library.custom_op("slime::flash_varlen_causal", _forward, mutates_args=())
flash_varlen_causal.register_fake(_forward)
flash_varlen_causal.__doc__ = """Causal attention within each packed sample: q [T, Hq, D], k/v [T, Hkv, D] with Hq a
multiple of Hkv. Returns the output [T, Hq, D] and the log-sum-exp the backward needs."""
_flash_varlen_causal_backward = torch.library.custom_op("slime::flash_varlen_causal_backward", _backward_kernel,
                                                        mutates_args=())
_flash_varlen_causal_backward.register_fake(_backward_kernel)


def _save_for_backward(ctx, inputs, output):
    q, k, v, cu_seqlens, max_len, scale = inputs
    out, log_sum_exp = output
    ctx.save_for_backward(q, k, v, out, log_sum_exp, cu_seqlens)
    ctx.max_len, ctx.scale = max_len, scale


def _backward(ctx, grad_out, grad_log_sum_exp):
    q, k, v, out, log_sum_exp, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = _flash_varlen_causal_backward(grad_out, q, k, v, out, log_sum_exp, cu_seqlens, ctx.max_len,
                                               ctx.scale)
    return dq, dk, dv, None, None, None


flash_varlen_causal.register_autograd(_backward, setup_context=_save_for_backward)


def register() -> str:
    """Make `attn_implementation=VARLEN` known to transformers (idempotent); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN, varlen_attention_forward)
    AttentionMaskInterface.register(VARLEN, lambda *args, **kwargs: None)  # no mask: cu_seqlens separates samples
    return VARLEN
