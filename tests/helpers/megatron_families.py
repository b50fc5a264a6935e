"""Tiny GLM-4, GLM-4.5 and DeepSeek-V3 checkpoints built with transformers for the Megatron backend's tests: fp32,
weights drawn wider than the default initialisation (so that a wrong computation shows in the logits) and random
expert-score correction biases (so that a bias left at zero routes differently).

Variants: `glm4` (sandwich norms, interleaved half RoPE, q/k/v bias), `glm4_moe` (q/k norm, q/k/v bias, one dense
layer, shared expert, routed scaling), `deepseek_v3` (MLA with q_lora, YaRN, 4 expert groups of which 2 are kept:
topk // topk_group = 1, where megatron-core's own group rule differs from transformers'), `moonlight` (MLA without
q_lora, one group, plain RoPE, two shared experts), `glm4_moe_lite` (GLM-4.7-Flash: MLA with the V head as wide as the
query-key head, dense / sparse layers from `mlp_layer_types`).
"""

from __future__ import annotations

import torch

FAMILIES = ("glm4", "glm4_moe", "deepseek_v3", "moonlight")
FLASH = "glm4_moe_lite"  # GLM-4.7-Flash's architecture: DeepSeek-V3's MLA and router, its own config class
MOE_FAMILIES = ("glm4_moe", "deepseek_v3", "moonlight")

_COMMON = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, rms_norm_eps=1e-6,
               tie_word_embeddings=False, max_position_embeddings=256)
_MOE = dict(moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
            first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5)
_MLA = dict(kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)


def family_config(family: str, vocab_size: int, **overrides):
    from transformers import DeepseekV3Config, Glm4Config, Glm4MoeConfig

    common = {**_COMMON, "vocab_size": vocab_size}
    if family == "glm4":
        return Glm4Config(**{**common, "num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 16,
                             "attention_bias": True, "partial_rotary_factor": 0.5, **overrides})
    if family == "glm4_moe":
        return Glm4MoeConfig(**{**common, **_MOE, "num_hidden_layers": 3, "num_key_value_heads": 2, "head_dim": 16,
                                "attention_bias": True, "use_qk_norm": True, "partial_rotary_factor": 0.5,
                                "n_group": 1, "topk_group": 1, **overrides})
    if family == "deepseek_v3":
        rope = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
                    beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
        return DeepseekV3Config(**{**common, **_MLA, **_MOE, "num_hidden_layers": 3, "num_key_value_heads": 4,
                                   "q_lora_rank": 32, "n_group": 4, "topk_group": 2, "rope_parameters": rope,
                                   **overrides})
    if family == "moonlight":
        return DeepseekV3Config(**{**common, **_MLA, **_MOE, "num_hidden_layers": 3, "num_key_value_heads": 4,
                                   "q_lora_rank": None, "n_group": 1, "topk_group": 1, "n_shared_experts": 2,
                                   **overrides})
    if family == FLASH:
        from transformers import Glm4MoeLiteConfig

        return Glm4MoeLiteConfig(**{**common, **_MLA, **_MOE, "num_hidden_layers": 3, "num_key_value_heads": 4,
                                    "q_lora_rank": 24, "v_head_dim": 24, "routed_scaling_factor": 1.8,
                                    "mlp_layer_types": ["dense", "sparse", "sparse"], **overrides})
    raise ValueError(family)


@torch.no_grad()
def widen(model, seed: int = 1) -> None:
    """Matrices ~ N(0, 0.15) (routers 0.3), norm weights ~ 1 + N(0, 0.2), biases ~ N(0, 0.3), expert-score
    corrections ~ N(0, 0.05) (seed 1: every expert gets tokens of test_parallel's batch in every family)."""
    generator = torch.Generator().manual_seed(seed)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if not tensor.is_floating_point():
            continue
        noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32).to(tensor.dtype)
        if "norm" in name:
            tensor.copy_(1.0 + 0.2 * noise)
        elif name.endswith("mlp.gate.weight"):  # router: scores spread like the bias, every expert gets tokens
            tensor.copy_(0.3 * noise)
        elif "e_score_correction" in name:  # moves choices, yet leaves every expert some tokens
            tensor.copy_(0.05 * noise)
        elif tensor.dim() == 1 and "bias" in name:
            tensor.copy_(0.3 * noise)
        elif tensor.dim() >= 2:
            tensor.copy_(0.15 * noise)


def build_family_checkpoint(path, family: str, **overrides):
    """A tokenizer (vocabulary ~300) and a widened tiny model of `family` saved under `path`; returns `path`."""
    from transformers import AutoModelForCausalLM

    from slime.utils.tiny_model import build_tokenizer

    tokenizer = build_tokenizer(path, None, vocab_size=300)
    config = family_config(family, len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                           eos_token_id=tokenizer.eos_token_id, bos_token_id=None, **overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    widen(model)
    model.save_pretrained(path)
    return path
