"""Tiny configs of the DeepSeek-V3 family (multi-head latent attention) for `tiny_model.build_tiny_model`:
"deepseek_v3" (q_lora_rank set, DeepSeek-YaRN with both mscales, 4 expert groups of which 2 are kept),
"moonlight" (q_lora_rank null: a plain q_proj, plain RoPE, one group) and "glm4_moe_lite" (GLM-4.7-Flash's shape,
with attention_bias on).
Every head's value dim differs from its query/key dim, as in the released models. Kimi K2 is the deepseek_v3 one
with config.json's model_type rewritten to "kimi_k2" (how Kimi ships it; transformers has no kimi_k2 type).
Sizes are for CPU tests; nothing here downloads anything.
"""

from __future__ import annotations

MLA_SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
                 kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                 n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                 norm_topk_prob=True)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=256, mscale=1.0,
            mscale_all_dim=0.8, beta_fast=32.0, beta_slow=1.0)
TINY_MLA_ARCHES = {
    "deepseek_v3": dict(q_lora_rank=32, n_group=4, topk_group=2, routed_scaling_factor=2.5, rope_parameters=YARN,
                        first_k_dense_replace=1),
    "moonlight": dict(q_lora_rank=None, n_group=1, topk_group=1, routed_scaling_factor=2.446,
                      rope_parameters=dict(rope_type="default", rope_theta=50000.0), first_k_dense_replace=1),
    "glm4_moe_lite": dict(q_lora_rank=32, n_group=1, topk_group=1, routed_scaling_factor=1.8, v_head_dim=16,
                          attention_bias=True,
                          rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
}


def tiny_mla_fields(arch: str) -> dict:
    """The fields a tiny `arch` (a TINY_MLA_ARCHES key) sets over tiny_model's common ones (overrides come last)."""
    return {**MLA_SHAPE, **TINY_MLA_ARCHES[arch]}


def tiny_mla_config(arch: str, fields: dict):
    """The transformers config of a tiny `arch` from its merged `fields`. glm4_moe_lite reads `num_dense_layers`
    (default 1) for its mlp_layer_types; the others read first_k_dense_replace. No multi-token-prediction layer."""
    from transformers import DeepseekV3Config, Glm4MoeLiteConfig

    fields = {key: value for key, value in fields.items() if key != "head_dim"}
    num_dense = fields.pop("num_dense_layers", 1)
    if arch == "glm4_moe_lite":
        fields["mlp_layer_types"] = ["dense"] * num_dense + ["sparse"] * (fields["num_hidden_layers"] - num_dense)
        return Glm4MoeLiteConfig(**fields)
    return DeepseekV3Config(num_nextn_predict_layers=0, **fields)
