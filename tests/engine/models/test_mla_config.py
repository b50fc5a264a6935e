"""Released DeepSeek-family config.json files read by the engine (fields as the releases publish them: DeepSeek-V3's
old-style `rope_scaling` with `type: yarn` and block-FP8 `quantization_config`, Moonlight's null q_lora_rank, Kimi
K2's own model_type): the MLA sizes, the latent cache row (576 values), the router's groups and dense layers; and
DeepSeek-YaRN's frequencies, cos/sin magnitude and softmax scale against transformers' own functions."""

import math

import pytest
import torch

from slime.engine.config import Config
from slime.engine.kv_cache import bytes_per_block, cache_row_shape
from slime.engine.layers.mla_rotary import MLARotaryEmbedding, yarn_inv_freq
from slime.engine.models.model_config import parse_model_config

DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 2048, "moe_layer_freq": 1,
    "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                            "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "topk_group": 4,
    "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 129280,
    "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
}
MOONLIGHT = {
    **{key: value for key, value in DEEPSEEK_V3.items() if key != "quantization_config"}, "hidden_size": 2048, "intermediate_size": 11264, "moe_intermediate_size": 1408,
    "num_attention_heads": 16, "num_key_value_heads": 16, "num_hidden_layers": 27, "first_k_dense_replace": 1,
    "n_routed_experts": 64, "num_experts_per_tok": 6, "n_shared_experts": 2, "n_group": 1, "topk_group": 1,
    "routed_scaling_factor": 2.446, "q_lora_rank": None, "rope_scaling": None, "rope_theta": 50000.0,
    "max_position_embeddings": 8192, "vocab_size": 163840, "num_nextn_predict_layers": 0,
}
KIMI_K2 = {
    **DEEPSEEK_V3, "model_type": "kimi_k2", "num_attention_heads": 64, "num_key_value_heads": 64,
    "n_routed_experts": 384, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.827, "rope_theta": 50000.0, "vocab_size": 163840, "max_position_embeddings": 131072,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
}


@pytest.mark.parametrize("raw,heads,dense,q_lora,groups", [
    (DEEPSEEK_V3, 128, 3, 1536, (8, 4)), (MOONLIGHT, 16, 1, None, (1, 1)), (KIMI_K2, 64, 1, 1536, (1, 1))])
def test_released_configs(raw, heads, dense, q_lora, groups):
    config = parse_model_config(raw)
    mla = config.mla
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_head_dim, mla.v_head_dim) == (q_lora, 512, 192, 128)
    assert mla.rope_interleave and config.num_attention_heads == heads
    assert config.moe_layers == tuple(range(dense, raw["num_hidden_layers"])) and config.router == "sigmoid"
    assert (config.n_group, config.topk_group) == groups
    assert config.shared_expert_intermediate_size == raw["n_shared_experts"] * raw["moe_intermediate_size"]
    # one 576-value latent row per token and layer: 2 bytes x 576 in bf16, against heads x (192 + 128) expanded
    assert cache_row_shape(config) == (1, 1, 576)
    engine = Config(model="unused", kvcache_block_size=1)
    assert bytes_per_block(engine, config, torch.bfloat16) == raw["num_hidden_layers"] * 576 * 2
    assert heads * (192 + 128) / 576 == pytest.approx({128: 71.1, 16: 8.9, 64: 35.6}[heads], abs=0.1)


def test_deepseek_yarn_equals_transformers():
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    for mscale_all_dim in (1.0, 0.707):
        rope = {**DEEPSEEK_V3["rope_scaling"], "mscale_all_dim": mscale_all_dim}
        hf_config = DeepseekV3Config(rope_parameters={**rope, "rope_type": "yarn", "rope_theta": 10000.0},
                                     max_position_embeddings=163840)
        expected_inv_freq, expected_magnitude = ROPE_INIT_FUNCTIONS["yarn"](hf_config, "cpu")
        config = parse_model_config({**DEEPSEEK_V3, "rope_scaling": rope})
        inv_freq, magnitude = yarn_inv_freq(64, 10000.0, config.mla.yarn)
        torch.testing.assert_close(inv_freq, expected_inv_freq, rtol=1e-6, atol=0)
        assert magnitude == pytest.approx(expected_magnitude)
        assert (magnitude == 1.0) == (mscale_all_dim == 1.0)
        assert config.mla.softmax_scale() == pytest.approx(yarn_apply_mscale(hf_config.rope_parameters, 192**-0.5))
        assert config.mla.softmax_scale() == pytest.approx(192**-0.5 * (0.1 * mscale_all_dim * math.log(40) + 1) ** 2)
        rotary = MLARotaryEmbedding(config.mla, 16, 10000.0)
        torch.testing.assert_close(rotary.cos[5, :32], torch.cos(5 * expected_inv_freq) * expected_magnitude)


def test_unsupported_quantization_and_rope_are_named():
    with pytest.raises(ValueError, match="quant_method='compressed-tensors'.*fp8_cast_bf16"):
        parse_model_config({**KIMI_K2, "quantization_config": {"quant_method": "compressed-tensors"}})
    with pytest.raises(ValueError, match="rope type 'longrope' for multi-head latent attention"):
        parse_model_config({**MOONLIGHT, "rope_scaling": {"type": "longrope", "factor": 2.0}})
    with pytest.raises(ValueError, match="needs kv_lora_rank"):
        parse_model_config({**MOONLIGHT, "kv_lora_rank": None})
