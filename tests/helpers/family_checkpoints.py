"""Tiny checkpoints of the GLM-4.5 and DeepSeek-V3 families, built with transformers in the tests (3 layers, the
first dense, hidden 64, weights drawn wide so logits spread), each with the Megatron model-shape flags of slime's
preset for it scaled down to the tiny shape (what the preset's flags become for this config, in the same flags).
Not the engine's or the trainers' family code: these are inputs for their tests."""

from __future__ import annotations

import shutil
from pathlib import Path

# The families' tiny configs: the fields of the released configs, scaled down (3 layers, the first dense).
_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
               max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=False, first_k_dense_replace=1,
               moe_intermediate_size=32, num_experts_per_tok=2, n_shared_experts=1, norm_topk_prob=True)
FAMILIES = {
    # GLM-4.5 (355B-A32B): partial RoPE, q/k norm, qkv bias, 1 group
    "glm4.5": dict(model_type="glm4_moe", num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5,
                   attention_bias=True, use_qk_norm=True, n_routed_experts=8, routed_scaling_factor=2.5, n_group=1,
                   topk_group=1, rope_theta=1000000.0),
    # GLM-4.7-Flash (30B-A3B): MLA with q_lora, 1 group
    "glm4.7-flash": dict(model_type="glm4_moe_lite", num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                         qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                         routed_scaling_factor=1.8, n_group=1, topk_group=1, rope_theta=1000000.0),
    # DeepSeek-V3 / R1: MLA with q_lora, YaRN, real group limits (4 groups, 2 picked: topk // group_topk == 1 here
    # would differ from HF's top-2 group score; 8 experts top-4 over 4 groups of 2 keeps Megatron's rule equal)
    "deepseek-v3": dict(model_type="deepseek_v3", num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                        num_experts_per_tok=4, routed_scaling_factor=2.5, n_group=4, topk_group=2, rope_theta=10000.0,
                        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
    # Kimi K2: DeepSeek-V3's shape with 1 group and model_type kimi_k2 in config.json
    "kimi-k2": dict(model_type="deepseek_v3", num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                    routed_scaling_factor=2.827, n_group=1, topk_group=1, rope_theta=50000.0,
                    rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                                  "beta_fast": 1, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
    # Moonlight-16B-A3B: no q_lora_rank (plain q_proj), 2 shared experts
    "moonlight": dict(model_type="deepseek_v3", num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16,
                      qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=2,
                      routed_scaling_factor=2.446, n_group=1, topk_group=1, rope_theta=50000.0),
}


def build_family_checkpoint(out_dir: Path, family: str, tokenizer_dir: Path, seed: int = 0, gain: float = 1.0) -> Path:
    """A random `family` model with the tokenizer of `tokenizer_dir` (its files copied), matrices ~ N(0, gain^2 /
    fan_in) (wider than transformers' 0.02, so logits spread)."""
    import json

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    fields = {**_COMMON, **FAMILIES[family]}
    model_type = fields.pop("model_type")
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id, bos_token_id=None, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, gain / param.shape[-1] ** 0.5)
        for name, buffer in model.named_buffers():  # a router bias that is not loaded then changes the routing
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.5)
    model.save_pretrained(out_dir, safe_serialization=True)
    for path in Path(tokenizer_dir).iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config", "vocab",
                                 "merges")):
            shutil.copy2(path, out_dir / path.name)
    if family == "kimi-k2":  # Kimi's config.json names its own model_type (transformers reads it as deepseek_v3)
        config_file = out_dir / "config.json"
        config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "model_type": "kimi_k2"}))
    return out_dir


def scaled_preset_flags(family: str) -> list[str]:
    """slime's preset flags for `family` with the tiny config's values (the flags of scripts/models/<preset>.sh)."""
    c = {**_COMMON, **FAMILIES[family]}
    num_dense, num_moe = c["first_k_dense_replace"], c["num_hidden_layers"] - c["first_k_dense_replace"]
    flags = ["--disable-bias-linear", "--num-layers", c["num_hidden_layers"], "--hidden-size", c["hidden_size"],
             "--ffn-hidden-size", c["intermediate_size"], "--num-attention-heads", c["num_attention_heads"],
             "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
             "--untie-embeddings-and-output-weights", "--rotary-base", int(c["rope_theta"]),
             "--num-experts", c["n_routed_experts"], "--moe-layer-freq", f"[0]*{num_dense}+[1]*{num_moe}",
             "--moe-ffn-hidden-size", c["moe_intermediate_size"], "--moe-router-topk", c["num_experts_per_tok"],
             "--moe-shared-expert-intermediate-size", c["moe_intermediate_size"] * c["n_shared_experts"],
             "--moe-router-pre-softmax", "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
             "--moe-router-bias-update-rate", "0", "--moe-router-load-balancing-type", "seq_aux_loss",
             "--moe-aux-loss-coeff", "0", "--moe-router-topk-scaling-factor", c["routed_scaling_factor"],
             "--moe-router-dtype", "fp32", "--moe-token-dispatcher-type", "alltoall"]
    if c["n_group"] > 1:
        flags += ["--moe-router-num-groups", c["n_group"], "--moe-router-group-topk", c["topk_group"]]
    if "kv_lora_rank" in c:
        flags += ["--multi-latent-attention", "--kv-lora-rank", c["kv_lora_rank"], "--qk-head-dim",
                  c["qk_nope_head_dim"], "--qk-pos-emb-head-dim", c["qk_rope_head_dim"], "--v-head-dim",
                  c["v_head_dim"], "--qk-layernorm", "--rotary-scaling-factor",
                  (c.get("rope_scaling") or {}).get("factor", 1), "--no-rope-fusion"]
        if c["q_lora_rank"] is not None:
            flags += ["--q-lora-rank", c["q_lora_rank"]]
    else:
        flags += ["--group-query-attention", "--num-query-groups", c["num_key_value_heads"], "--kv-channels",
                  c["head_dim"], "--add-qkv-bias", "--rotary-percent", c["partial_rotary_factor"]]
        if c["use_qk_norm"]:
            flags += ["--qk-layernorm"]
    return [str(flag) for flag in flags]
