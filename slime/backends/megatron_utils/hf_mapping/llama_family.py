"""HF <-> Megatron mapping of the Llama-layout dense models: Llama 3, Qwen2 / Qwen2.5 (QKV bias) and Qwen3
(q/k RMSNorm). The attention and embedding rules here serve the MoE families too.

Layouts (full tensors, see hf_mapping/__init__.py):
- `linear_qkv` interleaves per query group: for each of the `num_key_value_heads` groups, that group's query heads,
  then its key head, then its value head (so a TP shard holds whole groups);
- `linear_fc1` is [gate; up] as the tensor-parallel shards hold it: shard r's gate rows then shard r's up rows
  (tp_shards.py splits and joins it by halves), here with the TP size 1 view [gate; up];
- the vocabulary is padded to Megatron's multiple (zero rows), stripped on the way back;
- tied embeddings: no `output_layer.weight` on the Megatron side, no `lm_head.weight` on the HF side.
"""

from __future__ import annotations

import re

import torch

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")

_DIRECT = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}


def head_dim(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hf_config) -> torch.Tensor:
    groups = hf_config.num_key_value_heads
    rest = q.shape[1:]
    fused = torch.cat([q.reshape(groups, -1, *rest), k.reshape(groups, -1, *rest), v.reshape(groups, -1, *rest)],
                      dim=1)
    return fused.reshape(-1, *rest)


def split_qkv(fused: torch.Tensor, hf_config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, dim = hf_config.num_key_value_heads, head_dim(hf_config)
    heads_per_group = hf_config.num_attention_heads // groups
    rest = fused.shape[1:]
    grouped = fused.reshape(groups, (heads_per_group + 2) * dim, *rest)
    q, k, v = grouped.split([heads_per_group * dim, dim, dim], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def pad_vocab(weight: torch.Tensor, padded_size: int) -> torch.Tensor:
    if weight.shape[0] == padded_size:
        return weight
    return torch.cat([weight, weight.new_zeros(padded_size - weight.shape[0], *weight.shape[1:])])


def non_layer_to_megatron(name: str, read_hf, hf_config, padded_vocab: int) -> torch.Tensor:
    if name == "embedding.word_embeddings.weight":
        return pad_vocab(read_hf("model.embed_tokens.weight"), padded_vocab)
    if name == "output_layer.weight":
        return pad_vocab(read_hf("model.embed_tokens.weight" if hf_config.tie_word_embeddings else "lm_head.weight"),
                         padded_vocab)
    if name == "decoder.final_layernorm.weight":
        return read_hf("model.norm.weight")
    raise KeyError(name)


def non_layer_to_hf(name: str, tensor: torch.Tensor, hf_config) -> list[tuple[str, torch.Tensor]]:
    vocab = hf_config.vocab_size
    if name == "embedding.word_embeddings.weight":
        return [("model.embed_tokens.weight", tensor[:vocab])]
    if name == "output_layer.weight":
        # With tied embeddings a last pipeline stage holds its own copy of the embedding: the engine needs one.
        return [] if hf_config.tie_word_embeddings else [("lm_head.weight", tensor[:vocab])]
    if name == "decoder.final_layernorm.weight":
        return [("model.norm.weight", tensor)]
    raise KeyError(name)


def attention_to_megatron(layer: int, rest: str, read_hf, hf_config) -> torch.Tensor | None:
    prefix = f"model.layers.{layer}."
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = rest.rsplit(".", 1)[1]
        return fuse_qkv(*(read_hf(f"{prefix}self_attn.{p}_proj.{kind}") for p in "qkv"), hf_config)
    if rest in _DIRECT and not rest.startswith("mlp."):
        return read_hf(prefix + _DIRECT[rest])
    return None


def attention_to_hf(layer: int, rest: str, tensor: torch.Tensor, hf_config) -> list[tuple[str, torch.Tensor]] | None:
    prefix = f"model.layers.{layer}."
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = rest.rsplit(".", 1)[1]
        return [(f"{prefix}self_attn.{p}_proj.{kind}", t) for p, t in zip("qkv", split_qkv(tensor, hf_config))]
    if rest in _DIRECT and not rest.startswith("mlp."):
        return [(prefix + _DIRECT[rest], tensor)]
    return None


def to_megatron(name: str, read_hf, hf_config, padded_vocab: int) -> torch.Tensor:
    match = _LAYER.fullmatch(name)
    if match is None:
        return non_layer_to_megatron(name, read_hf, hf_config, padded_vocab)
    layer, rest = int(match[1]), match[2]
    prefix = f"model.layers.{layer}."
    tensor = attention_to_megatron(layer, rest, read_hf, hf_config)
    if tensor is not None:
        return tensor
    if rest == "mlp.linear_fc1.weight":
        return torch.cat([read_hf(prefix + "mlp.gate_proj.weight"), read_hf(prefix + "mlp.up_proj.weight")])
    if rest in _DIRECT:
        return read_hf(prefix + _DIRECT[rest])
    raise KeyError(name)


def to_hf(name: str, tensor: torch.Tensor, hf_config) -> list[tuple[str, torch.Tensor]]:
    match = _LAYER.fullmatch(name)
    if match is None:
        return non_layer_to_hf(name, tensor, hf_config)
    layer, rest = int(match[1]), match[2]
    prefix = f"model.layers.{layer}."
    pairs = attention_to_hf(layer, rest, tensor, hf_config)
    if pairs is not None:
        return pairs
    if rest == "mlp.linear_fc1.weight":
        gate, up = tensor.chunk(2)
        return [(prefix + "mlp.gate_proj.weight", gate), (prefix + "mlp.up_proj.weight", up)]
    if rest in _DIRECT:
        return [(prefix + _DIRECT[rest], tensor)]
    raise KeyError(name)
