"""HF <-> Megatron mapping of Qwen3-MoE: Qwen3's attention (q/k RMSNorm, grouped QKV) and embeddings from
llama_family.py, and a sparse MLP in every layer: the router (`mlp.gate`) and per-expert SwiGLU MLPs.

Expert names carry global expert numbers (names.py turns a rank's local experts into them), in either Megatron
layout: `mlp.experts.local_experts.{e}.linear_fc{1,2}.weight` (SequentialMLP, the local spec) or
`mlp.experts.linear_fc{1,2}.weight{e}` (TE's grouped experts, and each row of grouped_experts.py's stacked weights,
names.unstack_experts). fc1 is [gate; up] as in the dense MLP.
"""

from __future__ import annotations

import re

import torch

from slime.backends.megatron_utils.hf_mapping import llama_family

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.(?:local_experts\.(\d+)\.linear_fc([12])\.weight|linear_fc([12])\.weight(\d+))")


def expert_of(rest: str) -> tuple[int, str] | None:
    """(global expert number, "1" or "2") of a layer-relative expert weight name, None for another name."""
    match = _EXPERT.fullmatch(rest)
    if match is None:
        return None
    if match[1] is not None:
        return int(match[1]), match[2]
    return int(match[4]), match[3]


def to_megatron(name: str, read_hf, hf_config, padded_vocab: int) -> torch.Tensor:
    match = _LAYER.fullmatch(name)
    if match is None:
        return llama_family.non_layer_to_megatron(name, read_hf, hf_config, padded_vocab)
    layer, rest = int(match[1]), match[2]
    prefix = f"model.layers.{layer}."
    tensor = llama_family.attention_to_megatron(layer, rest, read_hf, hf_config)
    if tensor is not None:
        return tensor
    if rest == "pre_mlp_layernorm.weight":
        return read_hf(prefix + "post_attention_layernorm.weight")
    if rest == "mlp.router.weight":
        return read_hf(prefix + "mlp.gate.weight")
    expert = expert_of(rest)
    if expert is None:
        raise KeyError(name)
    index, fc = expert
    hf_prefix = f"{prefix}mlp.experts.{index}."
    if fc == "1":
        return torch.cat([read_hf(hf_prefix + "gate_proj.weight"), read_hf(hf_prefix + "up_proj.weight")])
    return read_hf(hf_prefix + "down_proj.weight")


def to_hf(name: str, tensor: torch.Tensor, hf_config) -> list[tuple[str, torch.Tensor]]:
    match = _LAYER.fullmatch(name)
    if match is None:
        return llama_family.non_layer_to_hf(name, tensor, hf_config)
    layer, rest = int(match[1]), match[2]
    prefix = f"model.layers.{layer}."
    pairs = llama_family.attention_to_hf(layer, rest, tensor, hf_config)
    if pairs is not None:
        return pairs
    if rest == "pre_mlp_layernorm.weight":
        return [(prefix + "post_attention_layernorm.weight", tensor)]
    if rest == "mlp.router.weight":
        return [(prefix + "mlp.gate.weight", tensor)]
    expert = expert_of(rest)
    if expert is None:
        raise KeyError(name)
    index, fc = expert
    hf_prefix = f"{prefix}mlp.experts.{index}."
    if fc == "1":
        gate, up = tensor.chunk(2)
        return [(hf_prefix + "gate_proj.weight", gate), (hf_prefix + "up_proj.weight", up)]
    return [(hf_prefix + "down_proj.weight", tensor)]
