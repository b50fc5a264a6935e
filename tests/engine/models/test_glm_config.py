"""The engine's reading of GLM config.json files as released (GLM-4-9B-0414, GLM-4.5-Air, GLM-4.5 355B: keys as
their published configs write them, e.g. a top-level partial_rotary_factor and rope_theta, an eos list, MTP layers)
and the configurations it refuses, each error naming the config field."""

import pytest

from slime.engine.models.model_config import parse_model_config

GLM4_9B = {"architectures": ["Glm4ForCausalLM"], "model_type": "glm4", "attention_bias": True, "head_dim": 128,
           "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 13696, "max_position_embeddings": 32768,
           "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 2, "partial_rotary_factor": 0.5,
           "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "tie_word_embeddings": False, "vocab_size": 151552,
           "eos_token_id": [151329, 151336, 151338], "torch_dtype": "bfloat16"}
GLM45_AIR = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": True,
             "first_k_dense_replace": 1, "head_dim": 128, "hidden_size": 4096, "intermediate_size": 10944,
             "max_position_embeddings": 131072, "moe_intermediate_size": 1408, "n_group": 1, "n_routed_experts": 128,
             "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 96, "num_experts_per_tok": 8,
             "num_hidden_layers": 46, "num_key_value_heads": 8, "num_nextn_predict_layers": 1,
             "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05, "rope_theta": 1000000, "routed_scaling_factor": 1.0,
             "tie_word_embeddings": False, "topk_group": 1, "use_qk_norm": False, "vocab_size": 151552,
             "eos_token_id": [151329, 151336, 151338]}
GLM45 = {**GLM45_AIR, "num_hidden_layers": 92, "first_k_dense_replace": 3, "hidden_size": 5120, "n_routed_experts": 160,
         "moe_intermediate_size": 1536, "routed_scaling_factor": 2.5, "use_qk_norm": True}


def test_glm4_9b():
    config = parse_model_config(GLM4_9B)
    assert (config.qkv_bias, config.o_proj_bias, config.rotary_dim, config.rope_interleaved, config.sandwich_norms,
            config.qk_norm) == (True, False, 64, True, True, False)
    assert config.rope_theta == 10000.0 and config.eos_token_ids == [151329, 151336, 151338] and not config.is_moe


@pytest.mark.parametrize("raw, dense, qk_norm, scaling", [(GLM45_AIR, 1, False, 1.0), (GLM45, 3, True, 2.5)])
def test_glm45(raw, dense, qk_norm, scaling):
    config = parse_model_config(raw)
    assert config.moe_layers == tuple(range(dense, raw["num_hidden_layers"]))
    assert (config.qkv_bias, config.o_proj_bias, config.qk_norm, config.rotary_dim, config.rope_interleaved) == (
        True, False, qk_norm, 64, False)
    assert (config.router, config.num_experts, config.num_experts_per_tok, config.n_group, config.topk_group) == (
        "sigmoid", raw["n_routed_experts"], 8, 1, 1)
    assert config.routed_scaling_factor == scaling and config.norm_topk_prob
    assert config.shared_expert_intermediate_size == raw["moe_intermediate_size"]
    assert config.num_nextn_predict_layers == 1 and config.rope_theta == 1000000


@pytest.mark.parametrize("change, field", [
    ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ({"topk_method": "greedy"}, "topk_method='greedy'"),
    ({"n_group": 3}, "n_group=3"),
    ({"n_group": 8, "topk_group": 9}, "topk_group=9"),
    ({"n_group": 64, "topk_group": 2}, "num_experts_per_tok=8"),  # 2 groups of 2 experts cannot hold 8
    ({"partial_rotary_factor": 0.01}, "partial_rotary_factor=0.01"),
    ({"n_routed_experts": None}, "n_routed_experts"),
])
def test_refused_configurations_name_the_field(change, field):
    with pytest.raises(ValueError, match=field.replace("(", r"\(")):
        parse_model_config({**GLM45_AIR, **change})
