"""HF <-> Megatron mapping of GLM-4 (Glm4ForCausalLM: GLM-4-0414, GLM-Z1): Llama's attention and embeddings
(llama_family.py; q/k/v biases in the grouped `linear_qkv`, no output bias), the two extra norms of
sandwich_norm_layer.py under their HF names, and the MLP's `gate_up_proj`, which the checkpoint already stores as
Megatron's `linear_fc1` ([gate; up]).
"""

from __future__ import annotations

import re

import torch

from slime.backends.megatron_utils.hf_mapping import llama_family

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_DIRECT = {
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "post_self_attn_layernorm.weight": "post_self_attn_layernorm.weight",
    "post_mlp_layernorm.weight": "post_mlp_layernorm.weight",
    "mlp.linear_fc1.weight": "mlp.gate_up_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}


def to_megatron(name: str, read_hf, hf_config, padded_vocab: int) -> torch.Tensor:
    match = _LAYER.fullmatch(name)
    if match is None:
        return llama_family.non_layer_to_megatron(name, read_hf, hf_config, padded_vocab)
    layer, rest = int(match[1]), match[2]
    tensor = llama_family.attention_to_megatron(layer, rest, read_hf, hf_config)
    if tensor is not None:
        return tensor
    if rest in _DIRECT:
        return read_hf(f"model.layers.{layer}.{_DIRECT[rest]}")
    raise KeyError(name)


def to_hf(name: str, tensor: torch.Tensor, hf_config) -> list[tuple[str, torch.Tensor]]:
    match = _LAYER.fullmatch(name)
    if match is None:
        return llama_family.non_layer_to_hf(name, tensor, hf_config)
    layer, rest = int(match[1]), match[2]
    pairs = llama_family.attention_to_hf(layer, rest, tensor, hf_config)
    if pairs is not None:
        return pairs
    if rest in _DIRECT:
        return [(f"model.layers.{layer}.{_DIRECT[rest]}", tensor)]
    raise KeyError(name)
