"""Where the engine runs and in which dtype: the Config's "auto" values resolved against this machine and the
checkpoint. Not here: the kernels' self-checks on the device (kernel_checks.py)."""

from __future__ import annotations

import torch


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
