"""The engine's device and dtypes from its config: where it runs, the weights' and activations' dtype, and the KV
cache's (the model dtype, or an 8-bit float that halves the bytes a decode step's attention reads).

An fp8 cache stores K and V rounded to the nearest fp8 value with no scale (SGLang's `--kv-cache-dtype fp8_e4m3`
without calibrated scales), saturating at the type's largest finite value; attention reads them back into the model
dtype. Not the place for quantised weights: those stay in the model dtype.
"""

from __future__ import annotations

import torch

from slime.engine.config import KV_CACHE_DTYPES

# Config.kv_cache_dtype values -> torch dtype (None: the model dtype).
KV_CACHE_TORCH_DTYPES = {
    "auto": None,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
assert set(KV_CACHE_TORCH_DTYPES) == set(KV_CACHE_DTYPES), "every Config.kv_cache_dtype value needs its torch dtype"


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but CUDA is not available; use device='cpu'")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device, checkpoint_dtype: str | None) -> torch.dtype:
    if dtype != "auto":
        return getattr(torch, dtype)
    if device.type == "cpu":
        return torch.float32
    return torch.float16 if checkpoint_dtype == "float16" else torch.bfloat16


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype: the model dtype ("auto", or that dtype named) or an fp8 type. A 16/32-bit cache in
    another dtype than the model's is refused: it would round K/V without saving what fp8 saves."""
    wanted = KV_CACHE_TORCH_DTYPES[kv_cache_dtype]
    if wanted is None or wanted in FP8_DTYPES:
        return wanted or model_dtype
    if wanted != model_dtype:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} differs from the model dtype {model_dtype}: use 'auto' "
                         "(the model dtype) or an 8-bit cache ('fp8_e4m3', 'fp8_e5m2')")
    return wanted


def to_cache_dtype(values: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """`values` rounded to the cache's dtype; into fp8, saturated at its largest finite value first (fp8_e4m3 has
    no infinity, and an unclamped cast turns an out-of-range value into NaN), as the Triton kernels' casts do."""
    if cache_dtype in FP8_DTYPES:
        largest = torch.finfo(cache_dtype).max
        return values.clamp(-largest, largest).to(cache_dtype)
    return values.to(cache_dtype)
