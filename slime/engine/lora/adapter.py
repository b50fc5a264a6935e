"""One LoRA adapter as the engine receives it: PEFT tensor names (`base_model.model.<module>.lora_A.weight` [r, in],
`.lora_B.weight` [out, r]) and a config dict with PEFT's fields (`r`, `lora_alpha`, `target_modules`, optionally
`use_rslora`). Read from a PEFT folder (adapter_config.json + adapter_model.safetensors) or from pushed tensors.

Validation here is what does not need the model (the pairs are complete, ranks agree with the config, unsupported
PEFT variants are refused); `targets.py` checks module names and shapes against the model. Every tensor's float64
sum is its checksum, computed on the tensors as received (before any cast or scaling), so a sender can compare it
with its own. Not the storage in the engine (`slots.py`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

PEFT_PREFIX = "base_model.model."
LORA_SUFFIXES = {".lora_A.weight": "A", ".lora_B.weight": "B"}
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


class AdapterError(ValueError):
    """An adapter the engine cannot serve (bad name, shape, rank, config); the server answers 400."""


@dataclass
class LoraAdapter:
    """`modules`: Hugging Face module path (e.g. `model.layers.0.self_attn.q_proj`) -> (A [r, in], B [out, r])."""

    rank: int
    scale: float
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]
    checksums: dict[str, float] = field(default_factory=dict)


def tensor_checksum(tensor: torch.Tensor) -> float:
    """The float64 sum of a tensor's values (what the trainer computes on its side of a push)."""
    return float(tensor.detach().to(torch.float64).sum().item())


def adapter_from_tensors(config: dict, named_tensors, max_rank: int) -> LoraAdapter:
    """Parse PEFT-named tensors and their config; AdapterError naming the first problem."""
    if not isinstance(config, dict):
        raise AdapterError(f"adapter config must be an object with 'r' and 'lora_alpha', got {type(config).__name__}")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"adapter config 'r' must be a positive int, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"adapter rank r={rank} exceeds the engine's max_lora_rank={max_rank} "
                           "(--max-lora-rank; slime: --sglang-max-lora-rank, default --lora-rank)")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise AdapterError(f"adapter config 'lora_alpha' must be a number, got {alpha!r}")
    for name in ("use_dora",):
        if config.get(name):
            raise AdapterError(f"adapter config '{name}' is not supported by the built-in engine (plain LoRA only)")
    for name in ("rank_pattern", "alpha_pattern"):
        if config.get(name):
            raise AdapterError(f"adapter config '{name}' (per-module ranks) is not supported; use one r for all")
    if config.get("bias") not in (None, "none"):
        raise AdapterError(f"adapter config 'bias' must be 'none', got {config.get('bias')!r}")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    checksums = {}
    for name, tensor in named_tensors:
        module, kind = _split_name(name)
        if tensor.dim() != 2:
            raise AdapterError(f"adapter tensor {name!r} must be 2-D, got shape {tuple(tensor.shape)}")
        if not tensor.is_floating_point():
            raise AdapterError(f"adapter tensor {name!r} must be floating point, got {tensor.dtype}")
        if kind in pairs.setdefault(module, {}):
            raise AdapterError(f"adapter tensor {name!r} is given twice")
        pairs[module][kind] = tensor
        checksums[name] = tensor_checksum(tensor)
    if not pairs:
        raise AdapterError("the adapter holds no lora_A / lora_B tensors")
    modules = {}
    for module, pair in pairs.items():
        missing = sorted(set(LORA_SUFFIXES.values()) - set(pair))
        if missing:
            raise AdapterError(f"adapter module {module!r} lacks its lora_{missing[0]}.weight")
        a, b = pair["A"], pair["B"]
        if a.shape[0] != rank or b.shape[1] != rank:
            raise AdapterError(f"adapter module {module!r}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do "
                               f"not have rank r={rank} of the config")
        modules[module] = (a, b)
    return LoraAdapter(rank, float(scale), modules, checksums)


def read_peft_folder(path: str | Path, max_rank: int) -> LoraAdapter:
    """A PEFT adapter folder (adapter_config.json + adapter_model.safetensors)."""
    from safetensors.torch import load_file

    folder = Path(path)
    if not (folder / CONFIG_FILE).is_file() or not (folder / WEIGHTS_FILE).is_file():
        raise AdapterError(f"lora_path {str(path)!r} is not a PEFT adapter folder (needs {CONFIG_FILE} and "
                           f"{WEIGHTS_FILE})")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except json.JSONDecodeError as error:
        raise AdapterError(f"{folder / CONFIG_FILE}: {error}") from None
    return adapter_from_tensors(config, load_file(str(folder / WEIGHTS_FILE)).items(), max_rank)


def _split_name(name: str) -> tuple[str, str]:
    if not isinstance(name, str) or not name.startswith(PEFT_PREFIX):
        raise AdapterError(f"adapter tensor name {name!r} must start with {PEFT_PREFIX!r} (PEFT naming)")
    for suffix, kind in LORA_SUFFIXES.items():
        if name.endswith(suffix):
            return name[len(PEFT_PREFIX) : -len(suffix)], kind
    raise AdapterError(f"adapter tensor name {name!r} must end with .lora_A.weight or .lora_B.weight")
