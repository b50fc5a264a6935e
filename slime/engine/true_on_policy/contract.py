"""Which models and layouts `--true-on-policy-mode` covers, decided once from the checkpoint's config.json (the
engine's `ModelConfig`) for the engine and both trainers: a covered model gets its `DecoderSpec`, anything else is
refused at start-up by name with the reason (never served or trained on an approximate path)."""

from __future__ import annotations

from slime.engine.models.model_config import ModelConfig
from slime.engine.true_on_policy.tile_decoder import DecoderSpec

COVERED_MODEL_TYPES = ("qwen2", "qwen3", "llama")
# model_type -> why the mode refuses it (the batch-invariant decoder does not implement that part yet)
REFUSED_MODEL_TYPES = {
    "qwen3_moe": "mixture-of-experts layers (and their routing replay) are not in the batch-invariant decoder",
    "qwen2_moe": "mixture-of-experts layers (and their routing replay) are not in the batch-invariant decoder",
    "glm4": "GLM-4's sandwich norms and interleaved partial RoPE are not in the batch-invariant decoder",
    "glm4_moe": "GLM-4.5's sigmoid-routed experts and partial RoPE are not in the batch-invariant decoder",
    "deepseek_v3": "multi-head latent attention (DeepSeek MLA) is not in the batch-invariant decoder",
    "kimi_k2": "multi-head latent attention (DeepSeek MLA) is not in the batch-invariant decoder",
    "glm4_moe_lite": "multi-head latent attention (DeepSeek MLA) is not in the batch-invariant decoder",
}
FIX = "run without --true-on-policy-mode (measure the mismatch with --get-mismatch-metrics / TIS instead)"


def decoder_spec(config: ModelConfig) -> DecoderSpec:
    """The covered model's spec; ValueError naming the model family (or config field) otherwise."""
    name = f"--true-on-policy-mode: model_type {config.model_type!r}"
    if config.model_type in REFUSED_MODEL_TYPES:
        raise ValueError(f"{name} is not covered: {REFUSED_MODEL_TYPES[config.model_type]}; covered model types: "
                         f"{', '.join(COVERED_MODEL_TYPES)}; {FIX}")
    if config.model_type not in COVERED_MODEL_TYPES:
        raise ValueError(f"{name} is not covered; covered model types: {', '.join(COVERED_MODEL_TYPES)}; {FIX}")
    if config.rope_scaling is not None:
        raise ValueError(f"{name} with rope_scaling (llama3 RoPE scaling) is not covered: the batch-invariant decoder "
                         f"implements plain RoPE; {FIX}")
    if config.o_proj_bias:
        raise ValueError(f"{name} with attention_bias on o_proj is not covered; {FIX}")
    if config.num_attention_heads % config.num_key_value_heads:
        raise ValueError(f"{name}: num_attention_heads must be a multiple of num_key_value_heads")
    return DecoderSpec(num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
                       head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps, rope_theta=config.rope_theta,
                       qk_norm=config.qk_norm)
