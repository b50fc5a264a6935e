"""Block-FP8 checkpoints (DeepSeek V3 / R1, Kimi K2 as released): float8_e4m3fn weights, each with a float32
`weight_scale_inv` [ceil(rows / 128), ceil(columns / 128)] that multiplies its 128 x 128 block. The engine
dequantizes them while loading (weight = fp8 value x the block's scale, then the model's dtype) and computes in
bf16 / fp32; any other quantization is refused with the conversion to run.

Not the fp8 KV cache (`dtypes.py`), and not FP8 compute: the weights are held dequantized.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

SCALE_SUFFIX = "_scale_inv"  # "<module>.weight_scale_inv" scales "<module>.weight"
FP8_WEIGHT_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
CONVERSION_HINT = ("convert the checkpoint to bf16 first (slime's tools/fp8_cast_bf16.py --input-fp8-hf-path "
                   "IN --output-bf16-hf-path OUT for DeepSeek-style block FP8)")


def fp8_weight_block_size(raw_config: dict) -> tuple[int, int] | None:
    """The [rows, columns] weight block of a config.json's block-FP8 `quantization_config`, None for an
    unquantized checkpoint; ValueError for a quantization the engine cannot load."""
    quantization = raw_config.get("quantization_config")
    if not quantization:
        return None
    method = quantization.get("quant_method")
    block = quantization.get("weight_block_size")
    if method != "fp8" or not block or len(block) != 2:
        raise ValueError(f"config.json quantization_config (quant_method={method!r}, weight_block_size={block!r}): "
                         f"the engine loads unquantized and block-FP8 (quant_method 'fp8' with weight_block_size) "
                         f"checkpoints only; {CONVERSION_HINT}")
    return int(block[0]), int(block[1])


def checkpoint_fp8_block_size(model_path: str | Path) -> tuple[int, int] | None:
    config_file = Path(model_path) / "config.json"
    return fp8_weight_block_size(json.loads(config_file.read_text())) if config_file.is_file() else None


def dequantize_block(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 weight [rows, columns]: each (block rows x block columns) tile times its scale."""
    rows, columns = weight.shape
    expected = (-(-rows // block[0]), -(-columns // block[1]))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"weight_scale_inv of shape {tuple(scale_inv.shape)} for a {rows} x {columns} weight in "
                         f"{block[0]} x {block[1]} blocks; expected {expected}")
    scales = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :columns]
    return weight.float() * scales


def dequantize_fp8_blocks(named_tensors: Iterable[tuple[str, torch.Tensor]],
                          block: tuple[int, int]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with every fp8 weight dequantized by its `weight_scale_inv` (in whichever order the
    two arrive) and the scales themselves consumed; ValueError for an fp8 weight without its scale or the reverse."""
    weights: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, tensor in named_tensors:
        if name.endswith(SCALE_SUFFIX):
            weight_name = name[: -len(SCALE_SUFFIX)]
            if weight_name in weights:
                yield weight_name, dequantize_block(weights.pop(weight_name), tensor, block)
            else:
                scales[weight_name] = tensor
        elif tensor.dtype in FP8_WEIGHT_DTYPES:
            if name in scales:
                yield name, dequantize_block(tensor, scales.pop(name), block)
            else:
                weights[name] = tensor
        else:
            yield name, tensor
    if weights or scales:
        unpaired = sorted(weights) + [f"{name}{SCALE_SUFFIX}" for name in sorted(scales)]
        raise ValueError(f"block-FP8 checkpoint: {unpaired[:4]} lack their weight / weight_scale_inv partner")
