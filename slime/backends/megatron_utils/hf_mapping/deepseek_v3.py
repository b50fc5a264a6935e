"""HF <-> Megatron mapping of the DeepSeek-V3 family (DeepseekV3ForCausalLM: DeepSeek V3 / V3.1 / R1, Moonlight;
GLM-4.7-Flash's `glm4_moe_lite`): multi-head latent attention under megatron-core's local-spec names, every tensor a
plain copy (megatron-core de-interleaves the rope dims inside its RoPE), and GLM-4.5's feed-forward (glm4_moe.py).

    self_attn.q_a_proj            <-> self_attention.linear_q_down_proj   (q_lora_rank set)
    self_attn.q_a_layernorm       <-> self_attention.q_layernorm
    self_attn.q_b_proj            <-> self_attention.linear_q_up_proj
    self_attn.q_proj              <-> self_attention.linear_q_proj        (q_lora_rank null: Moonlight)
    self_attn.kv_a_proj_with_mqa  <-> self_attention.linear_kv_down_proj  ([kv_lora_rank | qk_rope_head_dim] rows)
    self_attn.kv_a_layernorm      <-> self_attention.kv_layernorm
    self_attn.kv_b_proj           <-> self_attention.linear_kv_up_proj    (per head [nope | v] rows)
    self_attn.o_proj              <-> self_attention.linear_proj
Multi-token-prediction layers and FP8 scales (`*.weight_scale_inv`) of released checkpoints are never read (an FP8
checkpoint fails on the shape of its weights: convert it to bf16 first).
"""

from __future__ import annotations

import re

import torch

from slime.backends.megatron_utils.hf_mapping import glm4_moe, llama_family

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_ATTENTION = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
}


def to_megatron(name: str, read_hf, hf_config, padded_vocab: int) -> torch.Tensor:
    match = _LAYER.fullmatch(name)
    if match is None:
        return llama_family.non_layer_to_megatron(name, read_hf, hf_config, padded_vocab)
    layer, rest = int(match[1]), match[2]
    if rest in _ATTENTION:
        return read_hf(f"model.layers.{layer}.{_ATTENTION[rest]}")
    tensor = glm4_moe.feed_forward_to_megatron(layer, rest, read_hf)
    if tensor is None:
        raise KeyError(name)
    return tensor


def to_hf(name: str, tensor: torch.Tensor, hf_config) -> list[tuple[str, torch.Tensor]]:
    match = _LAYER.fullmatch(name)
    if match is None:
        return llama_family.non_layer_to_hf(name, tensor, hf_config)
    layer, rest = int(match[1]), match[2]
    if rest in _ATTENTION:
        return [(f"model.layers.{layer}.{_ATTENTION[rest]}", tensor)]
    pairs = glm4_moe.feed_forward_to_hf(layer, rest, tensor)
    if pairs is None:
        raise KeyError(name)
    return pairs
