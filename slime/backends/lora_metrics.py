"""The trainer's LoRA metrics (issue #40 item 7) and the train processes' peak memory, for metrics.jsonl.

- `lora/trainable_params`: the values the optimizer trains, counted once however they are sharded (the adapters,
  under LoRA; the model's shared A of Megatron's fused q/k/v or gate/up layer counts once).
- `lora/adapter_norm`, `lora/lora_A_norm`, `lora/lora_B_norm`: L2 norms over every adapter tensor (as PEFT names
  them), so B's norm (zero at the start) shows how far training moved the policy from the base; with several
  adapters also per adapter (`lora/<name>/adapter_norm`, ...).
- `perf/train_peak_memory_gb`: the largest peak over the train ranks: on a GPU the bytes torch allocated at most
  since the last `reset_peak_memory` (one rollout's training), on the CPU the process's peak resident set size (the
  operating system's, never reset, so it is the peak so far).

Push bytes and seconds are the push's own (`perf/weight_push_gb`, `perf/weight_push_time`: weight_push_result.py).
Not the gathering of the adapter (the backends' `adapter_weights`).
"""

from __future__ import annotations

import math
import resource
import sys

import torch
import torch.distributed as dist

from slime.backends.lora_adapter import LORA_A, LORA_B, split_by_adapter


def adapter_norm_metrics(adapter: dict[str, torch.Tensor]) -> dict[str, float]:
    """L2 norms of the adapter {HF name: full tensor} (float64 sums of squares)."""
    squares = {LORA_A: 0.0, LORA_B: 0.0}
    for name, tensor in adapter.items():
        kind = LORA_A if f".{LORA_A}." in name else LORA_B
        squares[kind] += float(tensor.detach().to(torch.float64).square().sum())
    return {"lora/adapter_norm": math.sqrt(squares[LORA_A] + squares[LORA_B]),
            "lora/lora_A_norm": math.sqrt(squares[LORA_A]), "lora/lora_B_norm": math.sqrt(squares[LORA_B])}


def lora_metrics(backend, adapter_names: list[str] | None = None) -> dict[str, float]:
    """Collective (the adapter is gathered on every rank): the LoRA metrics of the trainer's current adapter; with
    several (`adapter_names`) also each one's norms, `lora/<name>/...`."""
    adapter = backend.adapter_weights()
    metrics = {"lora/trainable_params": float(backend.num_trainable_parameters()), **adapter_norm_metrics(adapter)}
    for name, part in split_by_adapter(adapter, adapter_names).items() if adapter_names else ():
        metrics.update({key.replace("lora/", f"lora/{name}/"): value
                        for key, value in adapter_norm_metrics(part).items()})
    return metrics


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gb(device: torch.device) -> float:
    """This process's peak memory (GB): allocated on a GPU since the last reset, resident on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / 1e9 if sys.platform == "darwin" else peak * 1024 / 1e9


def train_peak_memory_metrics(device: torch.device) -> dict[str, float]:
    """Collective over every train rank: the largest peak memory of any of them."""
    peak = torch.tensor([peak_memory_gb(device)], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return {"perf/train_peak_memory_gb": float(peak)}
