"""The config.json fields of the GLM families, as `ModelConfig` fields: GLM-4-0414 / GLM-Z1 (`glm4`,
Glm4ForCausalLM) and GLM-4.5 / 4.5-Air / 4.6 / 4.7 (`glm4_moe`, Glm4MoeForCausalLM).

- both: q/k/v bias from `attention_bias` (GLM-4 defaults it on, GLM-4.5 off) and never an o_proj bias; only the
  first `partial_rotary_factor * head_dim` dims of a head rotate (default 0.5), interleaved for GLM-4, rotate-half
  for GLM-4.5;
- GLM-4: four RMSNorms per layer (sandwich norms);
- GLM-4.5: optional per-head q/k RMSNorm (`use_qk_norm`), the sigmoid router with `e_score_correction_bias`,
  `n_group` / `topk_group` group limits and `routed_scaling_factor`, an ungated shared expert of
  `n_shared_experts * moe_intermediate_size`, the first `first_k_dense_replace` layers dense, and
  `num_nextn_predict_layers` multi-token-prediction layers in released checkpoints (the engine skips their weights).
Reads plain JSON; not the modules (decoder.py, sigmoid_moe_block.py) or the router math (layers/grouped_router.py).
"""

from __future__ import annotations

from slime.utils.moe_config import moe_layer_indices

GLM_MODEL_TYPES = ("glm4", "glm4_moe")
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5  # transformers' Glm4Config / Glm4MoeConfig default


def glm_fields(raw: dict, rope: dict) -> dict:
    """The ModelConfig fields that differ from the Qwen / Llama defaults for a glm4 / glm4_moe config.json (`rope`:
    its rope_parameters merged with rope_scaling)."""
    model_type = raw["model_type"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    factor = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY_FACTOR))
    rotary_dim = int(head_dim * factor)
    if rotary_dim % 2 or rotary_dim <= 0:
        raise ValueError(f"config.json partial_rotary_factor={factor} with head_dim={head_dim} gives {rotary_dim} "
                         "rotary dims; the engine needs an even number > 0")
    fields = dict(
        qkv_bias=bool(raw.get("attention_bias", model_type == "glm4")),
        o_proj_bias=False,
        rotary_dim=rotary_dim,
        rope_interleaved=model_type == "glm4",
        sandwich_norms=model_type == "glm4",
    )
    if model_type == "glm4_moe":
        fields.update(qk_norm=bool(raw.get("use_qk_norm", False)), **sigmoid_moe_fields(raw))
    return fields


def sigmoid_moe_fields(raw: dict) -> dict:
    """The MoE fields of a biased sigmoid-router config (GLM-4.5 and the DeepSeek-V3 family write the same keys)."""
    num_experts = raw.get("n_routed_experts")
    top_k = raw.get("num_experts_per_tok")
    if not num_experts or not top_k or top_k > num_experts:
        raise ValueError(f"config of a {raw['model_type']} model needs n_routed_experts >= num_experts_per_tok > 0, "
                         f"got {num_experts} and {top_k}")
    for key, value in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if raw.get(key, value) != value:
            raise ValueError(f"unsupported config: {key}={raw[key]!r}; the engine implements {key}={value!r}")
    n_group, topk_group = raw.get("n_group") or 1, raw.get("topk_group") or 1
    if num_experts % n_group or not 0 < topk_group <= n_group or top_k > topk_group * (num_experts // n_group):
        raise ValueError(f"config n_group={n_group}, topk_group={topk_group}: n_group must divide n_routed_experts="
                         f"{num_experts}, topk_group be in [1, n_group], and the kept groups hold >= "
                         f"num_experts_per_tok={top_k} experts")
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=raw["moe_intermediate_size"],
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        shared_expert_intermediate_size=raw["moe_intermediate_size"] * (raw.get("n_shared_experts") or 0),
        moe_layers=moe_layer_indices(raw),
        router="sigmoid",
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0),
    )
