"""Shared by the Megatron argument tests: the published config.json of each model the presets describe, written to a
folder, and the train.py flags of a small run on one of them."""

import json
from pathlib import Path

import pytest

_QWEN3 = {"model_type": "qwen3", "vocab_size": 151936, "rope_theta": 1000000, "rms_norm_eps": 1e-6,
          "head_dim": 128, "hidden_act": "silu", "attention_bias": False, "max_position_embeddings": 40960}
_QWEN2 = {"model_type": "qwen2", "vocab_size": 151936, "rope_theta": 1000000, "rms_norm_eps": 1e-6,
          "hidden_act": "silu", "max_position_embeddings": 32768}
_LLAMA3 = {"model_type": "llama", "vocab_size": 128256, "rope_theta": 500000, "rms_norm_eps": 1e-5,
           "head_dim": 128, "hidden_act": "silu", "attention_bias": False, "num_hidden_layers": 32, "hidden_size": 4096,
           "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
           "tie_word_embeddings": False}


def _shape(layers, hidden, ffn, heads, kv_heads, tied):
    return {"num_hidden_layers": layers, "hidden_size": hidden, "intermediate_size": ffn, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "tie_word_embeddings": tied}


# The published config.json of each model a preset describes (the facts the presets are checked against).
HF_CONFIGS = {
    "qwen3-0.6B": {**_QWEN3, **_shape(28, 1024, 3072, 16, 8, True)},
    "qwen3-1.7B": {**_QWEN3, **_shape(28, 2048, 6144, 16, 8, True)},
    "qwen3-4B": {**_QWEN3, **_shape(36, 2560, 9728, 32, 8, True)},
    "qwen3-8B": {**_QWEN3, **_shape(36, 4096, 12288, 32, 8, False)},
    "qwen3-30B-A3B": {**_QWEN3, **_shape(48, 2048, 6144, 32, 4, False), "model_type": "qwen3_moe",
                      "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                      "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True},
    "qwen1.5-MoE-A2.7B": {**_QWEN2, **_shape(24, 2048, 5632, 16, 16, False), "model_type": "qwen2_moe",
                          "max_position_embeddings": 8192, "num_experts": 60, "num_experts_per_tok": 4,
                          "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
                          "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": False},
    "qwen2.5-0.5B": {**_QWEN2, **_shape(24, 896, 4864, 14, 2, True)},
    "qwen2.5-1.5B": {**_QWEN2, **_shape(28, 1536, 8960, 12, 2, True), "rope_theta": 10000,  # Qwen2.5-Math-1.5B
                     "max_position_embeddings": 4096},
    "qwen2.5-3B": {**_QWEN2, **_shape(36, 2048, 11008, 16, 2, True)},
    "qwen2.5-7B": {**_QWEN2, **_shape(28, 3584, 18944, 28, 4, False), "vocab_size": 152064},
    "llama3-8B": {**_LLAMA3, "max_position_embeddings": 8192},
    "llama3.1-8B-Instruct": {**_LLAMA3, "max_position_embeddings": 131072,
                             "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    "glm4-9B": {"model_type": "glm4", **_shape(40, 4096, 13696, 32, 2, False), "vocab_size": 151552,
                "head_dim": 128, "rope_theta": 10000, "rms_norm_eps": 1e-5, "partial_rotary_factor": 0.5,
                "attention_bias": True, "hidden_act": "silu", "max_position_embeddings": 32768},
    **{name: {**config, "hidden_act": "silu"} for name, config in {
        # The published config.json of each GLM-4.5 / DeepSeek-V3-family model (huggingface.co/<repo>/blob/main/
        # config.json): zai-org/GLM-4.5 (4.6 and 4.7 share the shape), zai-org/GLM-4.5-Air, zai-org/GLM-4.7-Flash,
        # deepseek-ai/DeepSeek-V3 (V3.1 and R1 share it), moonshotai/Kimi-K2-Instruct, moonshotai/Moonlight-16B-A3B.
        # The fields the presets describe, as shared/reference/model-families.md section 1.0 lists them (gathered
        # from those pages and transformers 5.24); MTP, dtype and token-id fields left out.
        "glm4.5-355B-A32B": {
            "model_type": "glm4_moe", **_shape(92, 5120, 12288, 96, 8, False), "head_dim": 128, "vocab_size": 151552,
            "attention_bias": True, "partial_rotary_factor": 0.5, "rope_theta": 1000000, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 131072, "use_qk_norm": True, "n_routed_experts": 160, "n_shared_experts": 1,
            "num_experts_per_tok": 8, "moe_intermediate_size": 1536, "routed_scaling_factor": 2.5,
            "n_group": 1, "topk_group": 1, "first_k_dense_replace": 3, "norm_topk_prob": True},
        "glm4.5-106B-A12B": {
            "model_type": "glm4_moe", **_shape(46, 4096, 10944, 96, 8, False), "head_dim": 128, "vocab_size": 151552,
            "attention_bias": True, "partial_rotary_factor": 0.5, "rope_theta": 1000000, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 131072, "use_qk_norm": False, "n_routed_experts": 128, "n_shared_experts": 1,
            "num_experts_per_tok": 8, "moe_intermediate_size": 1408, "routed_scaling_factor": 1.0,
            "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "norm_topk_prob": True},
        "glm4.7-30B-A3B": {
            "model_type": "glm4_moe_lite", **_shape(47, 2048, 10240, 20, 20, False), "vocab_size": 154880,
            "attention_bias": False, "rope_theta": 1000000, "rms_norm_eps": 1e-5, "max_position_embeddings": 202752,
            "q_lora_rank": 768, "kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64,
            "v_head_dim": 256, "n_routed_experts": 64, "n_shared_experts": 1, "num_experts_per_tok": 4,
            "moe_intermediate_size": 1536, "routed_scaling_factor": 1.8, "n_group": 1, "topk_group": 1,
            "first_k_dense_replace": 1, "norm_topk_prob": True},
        "deepseek-v3": {
            "model_type": "deepseek_v3", **_shape(61, 7168, 18432, 128, 128, False), "vocab_size": 129280,
            "attention_bias": False, "rope_theta": 10000, "rms_norm_eps": 1e-6, "max_position_embeddings": 163840,
            "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                             "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
            "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
            "v_head_dim": 128, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
            "moe_intermediate_size": 2048, "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
            "topk_method": "noaux_tc", "scoring_func": "sigmoid", "first_k_dense_replace": 3, "moe_layer_freq": 1,
            "norm_topk_prob": True},
        "kimi-k2": {
            "model_type": "kimi_k2", **_shape(61, 7168, 18432, 64, 64, False), "vocab_size": 163840,
            "attention_bias": False, "rope_theta": 50000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 131072,
            "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                             "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
            "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
            "v_head_dim": 128, "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 8,
            "moe_intermediate_size": 2048, "routed_scaling_factor": 2.827, "n_group": 1, "topk_group": 1,
            "topk_method": "noaux_tc", "scoring_func": "sigmoid", "first_k_dense_replace": 1, "moe_layer_freq": 1,
            "norm_topk_prob": True},
        "moonlight": {
            "model_type": "deepseek_v3", **_shape(27, 2048, 11264, 16, 16, False), "vocab_size": 163840,
            "attention_bias": False, "rope_theta": 50000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 8192,
            "rope_scaling": None, "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64, "n_shared_experts": 2,
            "num_experts_per_tok": 6, "moe_intermediate_size": 1408, "routed_scaling_factor": 2.446,
            "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
            "first_k_dense_replace": 1, "moe_layer_freq": 1, "norm_topk_prob": True},
    }.items()},
}


def write_model(folder: Path, name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(HF_CONFIGS[name]))
    return folder


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("megatron_args") / "data.jsonl"
    path.write_text('{"input": "1+1", "label": "2"}\n')
    return path


def base(folder: Path, data: Path, *extra, model="qwen3-0.6B") -> list[str]:
    return ["--hf-checkpoint", str(write_model(folder / model, model)), "--prompt-data", str(data),
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--num-rollout", "2", "--rm-type", "math",
            *map(str, extra)]
