"""LoRA in `--true-on-policy-mode`: an adapted linear's output is the base tile linear plus, per output slice, the
adapter's delta (x @ A.T) @ B.T * scale computed with the tile ops (tile_ops.py) at the adapter's own rank, so the
engine (from the adapter it was given, not its zero-padded, scale-folded serving slots) and the trainer (from its
LoRALinear's lora_A / lora_B) add the same bits. A fused linear (qkv_proj: q, k, v; gate_up_proj: gate, up) adds the
slices' deltas side by side, zeros for a slice the adapter does not target. Not the serving path (engine/lora/).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slime.engine.true_on_policy import tile_ops

FUSED_SLICES = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
                "down": ("down_proj",)}


@dataclass
class LoraPair:
    a: torch.Tensor  # [rank, in]
    b: torch.Tensor  # [out, rank]
    scale: float


# per fused linear ("qkv", "o", "gate_up", "down"): one pair per slice (None: not adapted), in FUSED_SLICES order
LayerLora = dict[str, list[LoraPair | None]]


def lora_delta(x: torch.Tensor, pairs: list[LoraPair | None], slice_sizes: list[int]) -> torch.Tensor | None:
    """[TILE_ROWS, sum(slice_sizes)] delta of a (fused) linear on tile x, or None when no slice is adapted."""
    if all(pair is None for pair in pairs):
        return None
    parts = [x.new_zeros(x.shape[0], size) if pair is None
             else tile_ops.linear(tile_ops.linear(x, pair.a), pair.b) * pair.scale
             for pair, size in zip(pairs, slice_sizes, strict=True)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def adapted_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora: LayerLora | None,
                   name: str, slice_sizes: list[int]) -> torch.Tensor:
    """The tile linear x @ weight.T (+ bias), plus the adapter's delta when `lora` adapts `name`."""
    out = tile_ops.linear(x, weight, bias)
    delta = None if lora is None or name not in lora else lora_delta(x, lora[name], slice_sizes)
    return out if delta is None else out + delta
