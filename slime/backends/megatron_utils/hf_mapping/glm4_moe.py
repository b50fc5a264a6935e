"""HF <-> Megatron mapping of GLM-4.5 (Glm4MoeForCausalLM: GLM-4.5 / 4.6 / 4.7, 4.5-Air), and the feed-forward part
that the DeepSeek-V3 family shares with it (deepseek_v3.py).

Attention as Llama's (llama_family.py: grouped `linear_qkv` with q/k/v biases, optional q/k norms). Feed-forward:
the first `first_k_dense_replace` layers are dense SwiGLU MLPs (`mlp.{gate,up,down}_proj`); the others hold
- the router `mlp.gate.weight` and its expert-score correction bias `mlp.gate.e_score_correction_bias` (a buffer on
  both sides: Megatron's `mlp.router.expert_bias`; hf_weights.py loads it and exports it for saved checkpoints only,
  weight sync never sends it);
- the routed experts under qwen3_moe.py's names (either Megatron expert layout);
- the shared expert `mlp.shared_experts.{gate,up,down}_proj` (ungated; Megatron's `mlp.shared_experts.linear_fc1`
  [gate; up] and `linear_fc2`).
Multi-token-prediction layers of released checkpoints (`model.layers.{num_hidden_layers + k}.*`) are never read.
"""

from __future__ import annotations

import re

import torch

from slime.backends.megatron_utils.hf_mapping import llama_family, qwen3_moe

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_DIRECT = {
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_experts.down_proj.weight",
}
_GATED = {"mlp.linear_fc1.weight": "mlp.", "mlp.shared_experts.linear_fc1.weight": "mlp.shared_experts."}


def feed_forward_to_megatron(layer: int, rest: str, read_hf) -> torch.Tensor | None:
    prefix = f"model.layers.{layer}."
    if rest in _DIRECT:
        return read_hf(prefix + _DIRECT[rest])
    if rest in _GATED:
        hf_prefix = prefix + _GATED[rest]
        return torch.cat([read_hf(hf_prefix + "gate_proj.weight"), read_hf(hf_prefix + "up_proj.weight")])
    expert = qwen3_moe.expert_of(rest)
    if expert is None:
        return None
    index, fc = expert
    hf_prefix = f"{prefix}mlp.experts.{index}."
    if fc == "1":
        return torch.cat([read_hf(hf_prefix + "gate_proj.weight"), read_hf(hf_prefix + "up_proj.weight")])
    return read_hf(hf_prefix + "down_proj.weight")


def feed_forward_to_hf(layer: int, rest: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
    prefix = f"model.layers.{layer}."
    if rest in _DIRECT:
        return [(prefix + _DIRECT[rest], tensor)]
    if rest in _GATED:
        hf_prefix = prefix + _GATED[rest]
    else:
        expert = qwen3_moe.expert_of(rest)
        if expert is None:
            return None
        index, fc = expert
        hf_prefix = f"{prefix}mlp.experts.{index}."
        if fc == "2":
            return [(hf_prefix + "down_proj.weight", tensor)]
    gate, up = tensor.chunk(2)
    return [(hf_prefix + "gate_proj.weight", gate), (hf_prefix + "up_proj.weight", up)]


def to_megatron(name: str, read_hf, hf_config, padded_vocab: int) -> torch.Tensor:
    match = _LAYER.fullmatch(name)
    if match is None:
        return llama_family.non_layer_to_megatron(name, read_hf, hf_config, padded_vocab)
    layer, rest = int(match[1]), match[2]
    tensor = llama_family.attention_to_megatron(layer, rest, read_hf, hf_config)
    if tensor is None:
        tensor = feed_forward_to_megatron(layer, rest, read_hf)
    if tensor is None:
        raise KeyError(name)
    return tensor


def to_hf(name: str, tensor: torch.Tensor, hf_config) -> list[tuple[str, torch.Tensor]]:
    match = _LAYER.fullmatch(name)
    if match is None:
        return llama_family.non_layer_to_hf(name, tensor, hf_config)
    layer, rest = int(match[1]), match[2]
    pairs = llama_family.attention_to_hf(layer, rest, tensor, hf_config)
    if pairs is None:
        pairs = feed_forward_to_hf(layer, rest, tensor)
    if pairs is None:
        raise KeyError(name)
    return pairs
