"""MoE expert weights between transformers 5's in-memory layout and the checkpoint's: in memory each MoE layer holds
`mlp.experts.gate_up_proj` [num_experts, 2 * intermediate, hidden] (gate rows first) and `mlp.experts.down_proj`
[num_experts, hidden, intermediate]; Hugging Face checkpoints, SGLang and the built-in engine name one tensor per
expert and projection (`mlp.experts.<e>.gate_proj.weight`, `up_proj`, `down_proj`). The trainer's weights leave in
the checkpoint layout (engine pushes, saved checkpoints) and come back stacked (reference / teacher weights).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

STACKED_EXPERTS = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<projection>gate_up_proj|down_proj)$")


def per_expert_tensors(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, view) of every expert's projection of a stacked tensor; any other tensor as it is."""
    match = STACKED_EXPERTS.match(name)
    if match is None:
        yield name, tensor
        return
    prefix = match["prefix"]
    for expert in range(tensor.shape[0]):
        if match["projection"] == "down_proj":
            yield f"{prefix}.{expert}.down_proj.weight", tensor[expert]
        else:
            gate, up = tensor[expert].chunk(2)
            yield f"{prefix}.{expert}.gate_proj.weight", gate
            yield f"{prefix}.{expert}.up_proj.weight", up


def stacked_tensor(name: str, state: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The stacked in-memory tensor `name` built from a checkpoint's per-expert tensors; None if `name` is not a
    stacked expert tensor or `state` lacks its experts."""
    match = STACKED_EXPERTS.match(name)
    if match is None or f"{match['prefix']}.0.down_proj.weight" not in state:
        return None
    prefix, experts = match["prefix"], []
    num_experts = sum(1 for key in state if key.startswith(f"{prefix}.") and key.endswith(".down_proj.weight"))
    for expert in range(num_experts):
        if match["projection"] == "down_proj":
            experts.append(state[f"{prefix}.{expert}.down_proj.weight"])
        else:
            experts.append(torch.cat([state[f"{prefix}.{expert}.gate_proj.weight"],
                                      state[f"{prefix}.{expert}.up_proj.weight"]]))
    return torch.stack(experts)
