"""The megatron-core configuration of the GLM and DeepSeek families: Glm4ForCausalLM (GLM-4-0414, GLM-Z1),
Glm4MoeForCausalLM (GLM-4.5 / 4.6 / 4.7, 4.5-Air) and DeepseekV3ForCausalLM (DeepSeek V3 / V3.1 / R1, Moonlight,
GLM-4.7-Flash's `glm4_moe_lite`), as `TransformerConfig` keyword arguments read from the HF
config, and the refusals of what megatron-core cannot express as transformers computes it.

- GLM-4: four RMSNorms per layer (sandwich_norm_layer.py), interleaved RoPE on the first half of each head
  (`rotary_interleaved`, `rotary_percent` 0.5), q/k/v bias without an output bias.
- GLM-4.5: half-head NeoX RoPE, q/k/v bias, optional q/k RMSNorm, leading dense layers (`first_k_dense_replace` ->
  `moe_layer_freq`), an ungated shared expert, and the DeepSeek router: sigmoid scores, the expert-score correction
  bias (`expert_bias`, loaded from `e_score_correction_bias` and never updated: bias update rate 0) used only to
  choose, group-limited top-k (grouped_routing.py: transformers' group score), renormalised weights times
  `routed_scaling_factor`.
- DeepSeek-V3: multi-head latent attention on the local spec (mla_local_spec.py), DeepSeek-YaRN, the same router.

Not the layer specs (model.py) and not the weight names (hf_mapping/).
"""

from __future__ import annotations

DENSE_FAMILIES = ("glm4",)
MOE_FAMILIES = ("glm4_moe", "deepseek_v3", "glm4_moe_lite")
MLA_FAMILIES = ("deepseek_v3", "glm4_moe_lite")
FAMILIES = DENSE_FAMILIES + MOE_FAMILIES


def _refuse(hf_config, field: str, why: str) -> ValueError:
    return ValueError(f"--train-backend megatron: config.json field {field} = {getattr(hf_config, field, None)!r} "
                      f"({hf_config.model_type}): {why}")


def rope_parameters(hf_config) -> dict:
    return dict(getattr(hf_config, "rope_parameters", None) or {})


def rotary_percent(hf_config) -> float:
    rope = rope_parameters(hf_config)
    return float(rope.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)))


def moe_layer_pattern(hf_config) -> list[int]:
    """Per decoder layer 1 (sparse) or 0 (dense): `mlp_layer_types` where the config has it (GLM-4.7-Flash), else
    the first `first_k_dense_replace` layers are dense."""
    layer_types = getattr(hf_config, "mlp_layer_types", None)
    if layer_types is not None:
        if set(layer_types) - {"dense", "sparse"} or len(layer_types) != hf_config.num_hidden_layers:
            raise _refuse(hf_config, "mlp_layer_types", "one 'dense' or 'sparse' per decoder layer")
        return [int(kind == "sparse") for kind in layer_types]
    if int(getattr(hf_config, "moe_layer_freq", 1) or 1) != 1:
        raise _refuse(hf_config, "moe_layer_freq", "transformers makes every layer from first_k_dense_replace on "
                      "sparse, SGLang only every moe_layer_freq-th: no release has one other than 1")
    num_dense = int(hf_config.first_k_dense_replace)
    return [0 if layer < num_dense else 1 for layer in range(hf_config.num_hidden_layers)]


def _router(hf_config) -> dict:
    top_k, num_experts = hf_config.num_experts_per_tok, hf_config.n_routed_experts
    if not hf_config.norm_topk_prob:
        raise _refuse(hf_config, "norm_topk_prob", "megatron-core's sigmoid router always renormalises the top-k "
                      "weights; only norm_topk_prob true can be trained with --train-backend megatron")
    if top_k < 2:
        raise _refuse(hf_config, "num_experts_per_tok", "with one expert per token megatron-core leaves the sigmoid "
                      "weight unnormalised where transformers divides it by itself; use --train-backend fsdp")
    scoring = getattr(hf_config, "scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise _refuse(hf_config, "scoring_func", "the GLM-4.5 / DeepSeek-V3 router is sigmoid-scored")
    num_groups, group_topk = int(hf_config.n_group or 1), int(hf_config.topk_group or 1)
    if num_groups > 1:
        if num_experts % num_groups or num_experts // num_groups < 2:
            raise _refuse(hf_config, "n_group", f"{num_experts} experts must split into groups of at least 2 "
                          "(each group is scored by its top-2 experts)")
        if not 1 <= group_topk <= num_groups or group_topk * (num_experts // num_groups) < top_k:
            raise _refuse(hf_config, "topk_group", f"must keep enough of the {num_groups} groups for "
                          f"{top_k} experts per token")
    num_shared = int(getattr(hf_config, "n_shared_experts", 0) or 0)
    return dict(
        num_moe_experts=num_experts,
        moe_router_topk=top_k,
        moe_ffn_hidden_size=hf_config.moe_intermediate_size,
        moe_shared_expert_intermediate_size=hf_config.moe_intermediate_size * num_shared if num_shared else None,
        moe_shared_expert_gate=False,
        moe_layer_freq=moe_layer_pattern(hf_config),
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.0,  # RL: the engine routes with the checkpoint's bias, so must the trainer
        moe_router_topk_scaling_factor=float(hf_config.routed_scaling_factor),
        # grouped_routing.py replaces megatron-core's group score (the sum of the top topk // topk_group) by
        # transformers' (the sum of the top 2); megatron-core needs the group sizes to call it.
        moe_router_num_groups=num_groups if num_groups > 1 else None,
        moe_router_group_topk=group_topk if num_groups > 1 else None,
        moe_router_load_balancing_type="none",  # the router losses are router_losses.py's
        moe_aux_loss_coeff=0.0,
    )


def _attention(hf_config) -> dict:
    model_type = hf_config.model_type
    rope = rope_parameters(hf_config)
    if model_type in MLA_FAMILIES:
        return {}
    if rope.get("rope_type", "default") != "default":
        raise _refuse(hf_config, "rope_parameters", "GLM-4 / GLM-4.5 train with plain RoPE (rope_type 'default')")
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return dict(
        num_query_groups=hf_config.num_key_value_heads,
        kv_channels=head_dim,
        add_qkv_bias=bool(getattr(hf_config, "attention_bias", model_type == "glm4")),
        qk_layernorm=bool(getattr(hf_config, "use_qk_norm", False)),
        rotary_interleaved=model_type == "glm4",  # GLM-4 rotates pairs (0, 1), (2, 3)...; GLM-4.5 halves
    )


def mla_attention(hf_config) -> dict:
    """`MLATransformerConfig` fields of a DeepSeek-V3-family config (YaRN from rope_parameters)."""
    if not getattr(hf_config, "rope_interleave", True):
        raise _refuse(hf_config, "rope_interleave", "megatron-core's MLA always de-interleaves the rope dims "
                      "(DeepSeek's layout); a checkpoint with rope_interleave false cannot be trained here")
    if getattr(hf_config, "attention_bias", False):
        raise _refuse(hf_config, "attention_bias", "megatron-core's MLA has no projection biases")
    rope = rope_parameters(hf_config)
    rope_type = rope.get("rope_type", "default")
    fields = dict(
        num_query_groups=hf_config.num_attention_heads,
        q_lora_rank=hf_config.q_lora_rank,
        kv_lora_rank=hf_config.kv_lora_rank,
        qk_head_dim=hf_config.qk_nope_head_dim,
        qk_pos_emb_head_dim=hf_config.qk_rope_head_dim,
        v_head_dim=hf_config.v_head_dim,
        qk_layernorm=True,  # q_a_layernorm and kv_a_layernorm
        rotary_base=float(rope["rope_theta"]),
    )
    if rope_type == "default":
        # mscale_all_dim 0: no YaRN factor in the softmax scale, as transformers without YaRN
        return dict(fields, rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    if rope_type != "yarn":
        raise _refuse(hf_config, "rope_parameters", f"rope_type {rope_type!r}: MLA trains with 'default' or "
                      "'yarn' RoPE")
    if rope.get("truncate", True) is False:
        raise _refuse(hf_config, "rope_parameters", "YaRN with truncate false: megatron-core rounds the "
                      "correction range to integers")
    if rope.get("attention_factor") is not None:
        raise _refuse(hf_config, "rope_parameters", "an explicit YaRN attention_factor: megatron-core derives it "
                      "from mscale / mscale_all_dim")
    return dict(
        fields,
        rope_type="yarn",
        rotary_scaling_factor=float(rope["factor"]),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        beta_fast=float(rope.get("beta_fast") or 32),
        beta_slow=float(rope.get("beta_slow") or 1),
        mscale=float(rope.get("mscale") or 1.0),
        mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
    )


def family_fields(args, hf_config) -> dict:
    """TransformerConfig (MLATransformerConfig for the MLA families) keyword arguments of the family's
    architecture; the caller adds the sizes, parallelism and numerics shared by every family."""
    model_type = hf_config.model_type
    fields = dict(num_attention_heads=hf_config.num_attention_heads, ffn_hidden_size=hf_config.intermediate_size)
    if model_type in MLA_FAMILIES:
        if args.tensor_model_parallel_size >= hf_config.num_attention_heads > 1:
            raise ValueError(f"--tensor-model-parallel-size {args.tensor_model_parallel_size} leaves one attention "
                             f"head per rank of {hf_config.num_attention_heads} (config.json num_attention_heads): "
                             "multi-head latent attention trains here with at least two per rank; lower it")
        fields.update(mla_attention(hf_config))
    else:
        fields.update(_attention(hf_config))
    if model_type in MOE_FAMILIES:
        fields.update(_router(hf_config), moe_grouped_gemm=args.moe_grouped_gemm,
                      moe_router_dtype=args.moe_router_dtype or "fp32")
    return fields
