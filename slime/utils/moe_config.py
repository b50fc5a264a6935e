"""Mixture-of-experts facts of a Hugging Face config.json (Qwen3-MoE, Qwen2-MoE, GLM-4.5, DeepSeek-V3): which decoder
layers are sparse and how many experts each token is routed to. One token's routing record is SGLang's
[num_hidden_layers, top_k]: a row for EVERY decoder layer, the dense layers' rows zeros (SGLang's capture buffer is
zero-filled and only MoE layers write it); replay reads the MoE layers' rows by layer index (`moe_layer_indices`).
Shared by the engine, the rollout (decoding routed experts) and the trainer (routing replay). Plain JSON, no
transformers import; not the engine's model config (`slime.engine.models.model_config`).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path


def moe_layer_indices(config: dict) -> tuple[int, ...]:
    """Indices of the layers whose feed-forward is sparse; () for a dense config. transformers' rules: Qwen-MoE, not
    in mlp_only_layers and (index + 1) % decoder_sparse_step == 0; GLM-4.5 / DeepSeek-V3 (n_routed_experts), index
    >= first_k_dense_replace (and a multiple of moe_layer_freq, SGLang's DeepSeek rule; 1 in every release);
    GLM-4.7-Flash (glm4_moe_lite), the "sparse" entries of mlp_layer_types (default: all but the first)."""
    if config.get("n_routed_experts") and config.get("mlp_layer_types"):  # GLM-4.7-Flash (glm4_moe_lite)
        return tuple(index for index, kind in enumerate(config["mlp_layer_types"]) if kind == "sparse")
    if config.get("n_routed_experts") and config.get("model_type") == "glm4_moe_lite":
        return tuple(range(1, config["num_hidden_layers"]))  # transformers' default: the first layer dense
    if config.get("n_routed_experts"):
        first_sparse, frequency = config.get("first_k_dense_replace") or 0, config.get("moe_layer_freq") or 1
        return tuple(index for index in range(first_sparse, config["num_hidden_layers"]) if index % frequency == 0)
    if not (config.get("num_experts") or config.get("num_local_experts")):
        return ()
    sparse_step = config.get("decoder_sparse_step", 1)
    mlp_only = set(config.get("mlp_only_layers") or [])
    return tuple(
        index for index in range(config["num_hidden_layers"])
        if index not in mlp_only and (index + 1) % sparse_step == 0
    )


def checkpoint_moe_flags(config: dict) -> dict:
    """The values Megatron's MoE flags must take for this config.json (num_experts, moe_router_topk,
    moe_ffn_hidden_size, moe_shared_expert_intermediate_size, moe_router_score_function), for checking a preset:
    Qwen-MoE's softmax routers, GLM-4.5 / DeepSeek-V3's sigmoid ones (n_routed_experts, n_shared_experts)."""
    sigmoid = bool(config.get("n_routed_experts"))
    shared = ((config.get("n_shared_experts") or 0) * config.get("moe_intermediate_size", 0) if sigmoid
              else config.get("shared_expert_intermediate_size"))
    return {
        "num_experts": config.get("n_routed_experts") if sigmoid else config.get("num_experts",
                                                                                 config.get("num_local_experts")),
        "moe_router_topk": config.get("num_experts_per_tok"),
        "moe_ffn_hidden_size": config.get("moe_intermediate_size"),
        "moe_shared_expert_intermediate_size": shared or None,
        "moe_router_score_function": "sigmoid" if sigmoid else "softmax",
    }


@functools.lru_cache(maxsize=8)
def routing_shape(hf_checkpoint: str) -> tuple[int, int]:
    """(num_hidden_layers, top_k): one token's routing record (SGLang's layout) for the checkpoint at
    `hf_checkpoint`; ValueError for a dense model."""
    config_file = Path(hf_checkpoint) / "config.json"
    if not config_file.is_file():
        raise ValueError(f"--hf-checkpoint {hf_checkpoint}: no config.json to read the MoE routing shape from")
    config = json.loads(config_file.read_text())
    layers = moe_layer_indices(config)
    if not layers:
        raise ValueError(f"--hf-checkpoint {hf_checkpoint} is not a mixture-of-experts model (model_type "
                         f"{config.get('model_type')!r}): routing replay needs one")
    return int(config["num_hidden_layers"]), int(config["num_experts_per_tok"])
