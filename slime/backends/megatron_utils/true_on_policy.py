"""The Megatron backend under `--true-on-policy-mode` (tensor, pipeline, context and expert parallel size 1): a
packed micro-batch's log-probs and entropy from the batch-invariant decoder the engine runs
(backends/true_on_policy.py), over views of the GPTModel's own parameters: `linear_qkv` regrouped from Megatron's
per-query-group layout to [q; k; v], `linear_fc1` already [gate; up], the padded vocabulary rows never read (token
ids index the embedding; the output weight is cut to the real vocabulary). Gradients reach the parameters (and the
DDP buffers) through those views."""

from __future__ import annotations

from functools import partial

import torch

from slime.backends.megatron_utils.hf_mapping.llama_family import split_qkv
from slime.backends.megatron_utils.log_probs import output_weight
from slime.backends.packing import PackedMicroBatch, to_device
from slime.backends.true_on_policy import layer_over_samples, packed_log_probs_and_entropy
from slime.engine.true_on_policy.tile_decoder import DecoderSpec, LayerWeights


def _norm_weight(layer, fused_owner, name: str) -> torch.Tensor:
    """A pre-norm's weight: fused into the next linear (Transformer Engine's layer_norm_weight) or its own module."""
    fused = getattr(fused_owner, "layer_norm_weight", None)
    return fused if fused is not None else getattr(layer, name).weight


def megatron_layer_weights(layer, hf_config) -> LayerWeights:
    attn, mlp = layer.self_attention, layer.mlp
    bias = getattr(attn.linear_qkv, "bias", None)
    qk_norm = getattr(attn, "q_layernorm", None) is not None
    return LayerWeights(
        input_norm=_norm_weight(layer, attn.linear_qkv, "input_layernorm"),
        qkv_weight=torch.cat(split_qkv(attn.linear_qkv.weight, hf_config)),
        qkv_bias=None if bias is None or bias.numel() == 0 else torch.cat(split_qkv(bias, hf_config)),
        q_norm=attn.q_layernorm.weight if qk_norm else None, k_norm=attn.k_layernorm.weight if qk_norm else None,
        o_weight=attn.linear_proj.weight, post_norm=_norm_weight(layer, mlp.linear_fc1, "pre_mlp_layernorm"),
        gate_up_weight=mlp.linear_fc1.weight, down_weight=mlp.linear_fc2.weight,
    )


def _layer_call(layer, spec: DecoderSpec, hf_config, hidden, layout):
    return layer_over_samples(spec, megatron_layer_weights(layer, hf_config), hidden, layout)


def tile_forward(model, micro_batch: PackedMicroBatch, *, spec: DecoderSpec, hf_config, temperature: float, device):
    """(log_probs, entropy) of the micro-batch's response tokens through the GPTModel `model`'s weights."""
    layers = [partial(_layer_call, layer, spec, hf_config) for layer in model.decoder.layers]
    return packed_log_probs_and_entropy(
        model.embedding.word_embeddings.weight, layers, model.decoder.final_layernorm.weight,
        output_weight(model, hf_config.vocab_size), spec, to_device(micro_batch.input_ids, device),
        to_device(micro_batch.logit_index, device), to_device(micro_batch.target_ids, device),
        micro_batch.cu_seqlens, temperature)
