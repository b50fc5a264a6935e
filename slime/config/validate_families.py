"""The model-shape flags of slime's GLM-4.5 and DeepSeek-V3-family presets (scripts/models/glm4.5-*.sh,
glm4.7-30B-A3B.sh, deepseek-v3.sh, kimi-k2.sh, moonlight.sh) against --hf-checkpoint's config.json: multi-latent
attention's ranks and head dims, the YaRN factor, and the sigmoid router's scaling and groups.

Called by validate_megatron.py's model-shape check and flags_moe.py's MoE check; each rule raises through the
`require` it is given, naming the flag and the config.json field. Not the rules of the other families (there).
"""

from __future__ import annotations

# Megatron flag -> config.json key of multi-latent attention (DeepseekV3Config, Glm4MoeLiteConfig).
MLA_FLAG_TO_HF = {"q_lora_rank": "q_lora_rank", "kv_lora_rank": "kv_lora_rank", "qk_head_dim": "qk_nope_head_dim",
                  "qk_pos_emb_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim"}
# Megatron router flag -> config.json key of the sigmoid routers (GLM-4.5, DeepSeek-V3 family), and its value there
# when the key is absent.
ROUTER_FLAG_TO_HF = {"moe_router_topk_scaling_factor": ("routed_scaling_factor", 1.0),
                     "moe_router_num_groups": ("n_group", 1), "moe_router_group_topk": ("topk_group", 1)}


def is_mla(config: dict) -> bool:
    return "kv_lora_rank" in config


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_mla_flags(args, config: dict, require) -> None:
    """--multi-latent-attention and its ranks / head dims / YaRN factor must describe the checkpoint's attention."""
    if not args.multi_latent_attention:
        return
    require(is_mla(config), f"--multi-latent-attention: {args.hf_checkpoint}/config.json has no kv_lora_rank (model "
                            f"type {config.get('model_type')!r} is not a multi-latent-attention model)")
    for dest, key in MLA_FLAG_TO_HF.items():
        value, actual = getattr(args, dest), config.get(key)
        require(value == actual, f"{_flag(dest)} {value} does not match {key}={actual} in "
                                 f"{args.hf_checkpoint}/config.json; fix the model preset or the checkpoint")
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    factor = float(scaling.get("factor") or 1.0)
    require(float(args.rotary_scaling_factor) == factor,
            f"--rotary-scaling-factor {args.rotary_scaling_factor} does not match the rope_scaling factor {factor} "
            f"in {args.hf_checkpoint}/config.json")


def is_sigmoid_router(config: dict) -> bool:
    """GLM-4.5's and the DeepSeek-V3 family's router: sigmoid scores with a correction bias (their configs name the
    experts n_routed_experts)."""
    return "n_routed_experts" in config and config.get("scoring_func", "sigmoid") == "sigmoid"


def check_router_flags(args, config: dict, require) -> None:
    """The routed scaling factor and group limits of a sigmoid router's flags against config.json."""
    for dest, (key, absent) in ROUTER_FLAG_TO_HF.items():
        value = getattr(args, dest)
        if value is None:
            continue
        actual = config.get(key, absent)
        require(is_sigmoid_router(config) or dest == "moe_router_topk_scaling_factor",
                f"{_flag(dest)} {value}: {args.hf_checkpoint} routes by softmax without expert groups")
        require(float(value) == float(actual), f"{_flag(dest)} {value} does not match {key}={actual} in "
                                               f"{args.hf_checkpoint}/config.json; fix the model preset or the checkpoint")
