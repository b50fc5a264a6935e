"""Mixture-of-experts facts of a Hugging Face config.json (Qwen3-MoE, Qwen2-MoE, GLM-4.5, DeepSeek-V3): which
decoder layers are sparse and how many experts each token is routed to, i.e. the shape of one token's routing record
[num_moe_layers, top_k]. Shared by the engine, the rollout (decoding routed experts) and the trainer (routing
replay). Plain JSON, no transformers import; not the engine's model config (`slime.engine.models.model_config`).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path


def moe_layer_indices(config: dict) -> tuple[int, ...]:
    """Indices of the layers whose feed-forward is sparse (transformers' rules: Qwen-MoE's not in mlp_only_layers and
    (index + 1) % decoder_sparse_step == 0; GLM-4.5's and DeepSeek-V3's from first_k_dense_replace on); () for a
    dense config."""
    if config.get("n_routed_experts"):
        return tuple(range(config.get("first_k_dense_replace", 0), config["num_hidden_layers"]))
    if not (config.get("num_experts") or config.get("num_local_experts")):
        return ()
    sparse_step = config.get("decoder_sparse_step", 1)
    mlp_only = set(config.get("mlp_only_layers") or [])
    return tuple(
        index for index in range(config["num_hidden_layers"])
        if index not in mlp_only and (index + 1) % sparse_step == 0
    )


@functools.lru_cache(maxsize=8)
def routing_shape(hf_checkpoint: str) -> tuple[int, int]:
    """(num_moe_layers, top_k) of the checkpoint at `hf_checkpoint`; ValueError for a dense model."""
    config_file = Path(hf_checkpoint) / "config.json"
    if not config_file.is_file():
        raise ValueError(f"--hf-checkpoint {hf_checkpoint}: no config.json to read the MoE routing shape from")
    config = json.loads(config_file.read_text())
    layers = moe_layer_indices(config)
    if not layers:
        raise ValueError(f"--hf-checkpoint {hf_checkpoint} is not a mixture-of-experts model (model_type "
                         f"{config.get('model_type')!r}): routing replay needs one")
    return len(layers), int(config["num_experts_per_tok"])
