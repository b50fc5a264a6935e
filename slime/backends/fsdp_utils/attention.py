"""Attention over packed micro-batches on the GPU: FlashAttention's variable-length kernel (through
`torch.nn.attention.varlen`), registered with transformers as the attention implementation `slime_varlen`.

A packed row holds several samples back to back; `cu_seqlens` ([num_samples + 1], int32, cumulative lengths)
tells the kernel where each starts, so no token attends across samples and no [T, T] mask is ever built (sdpa
with restarting position_ids builds a dense block-diagonal mask: quadratic memory, and a slow masked kernel).
The model's forward passes `cu_seq_lens_q` / `max_length_q` (transformers' FlashAttention keyword names), and
transformers hands them through every decoder layer to `varlen_attention_forward`.

Not for the CPU: there the trainer keeps sdpa. `varlen_supported()` says whether this torch has the kernel.
"""

from __future__ import annotations

import inspect
import math

import torch

VARLEN = "slime_varlen"


def _import_varlen_attn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


_VARLEN_ATTN = _import_varlen_attn()


def varlen_supported(device: torch.device) -> bool:
    return device.type == "cuda" and _VARLEN_ATTN is not None and bool(_CAUSAL)


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
    if k.shape[1] != q.shape[1] and not _SUPPORTS_GQA:
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    out = _call_varlen(q.contiguous(), k.contiguous(), v.contiguous(), cu_seq_lens_q, int(max_length_q), scaling)
    return out.unsqueeze(0), None


def _call_varlen(q, k, v, cu_seqlens, max_len, scale):
    kwargs = dict(_CAUSAL)
    if "scale" in _PARAMS:
        kwargs["scale"] = scale
    elif scale is not None and not math.isclose(scale, q.shape[-1] ** -0.5):
        raise ValueError(f"this torch's varlen_attn has no scale argument; the model needs scale {scale}")
    if _SUPPORTS_GQA and k.shape[1] != q.shape[1]:
        kwargs["enable_gqa"] = True
    return _VARLEN_ATTN(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, **kwargs)


# The keyword set of varlen_attn changed across torch releases: 2.10 has is_causal; later ones window_size
# ((-1, 0) is causal), scale and, from 2.12, enable_gqa (earlier, K/V heads are repeated to the query heads).
_PARAMS = set(inspect.signature(_VARLEN_ATTN).parameters) if _VARLEN_ATTN is not None else set()
_CAUSAL = ({"is_causal": True} if "is_causal" in _PARAMS
           else {"window_size": (-1, 0)} if "window_size" in _PARAMS else {})
_SUPPORTS_GQA = "enable_gqa" in _PARAMS


def register() -> str:
    """Make `attn_implementation=VARLEN` known to transformers (idempotent); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN, varlen_attention_forward)
    AttentionMaskInterface.register(VARLEN, lambda *args, **kwargs: None)  # no mask: cu_seqlens separates samples
    return VARLEN


def cu_seqlens_of(sample_lengths: list[int]) -> torch.Tensor:
    """[0, l0, l0 + l1, ...] as int32, the kernel's sample boundaries within a packed row."""
    cumulative = [0]
    for length in sample_lengths:
        cumulative.append(cumulative[-1] + length)
    return torch.tensor(cumulative, dtype=torch.int32)
