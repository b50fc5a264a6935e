"""Model implementations the engine runs: `load_model_config(model_path)` reads config.json and
`DecoderForCausalLM(config)` builds the module (weights not loaded). Supported (`SUPPORTED_MODEL_TYPES`): Qwen2 /
Qwen2.5, Qwen3, Llama 3 and GLM-4 dense decoders and the Qwen3-MoE / Qwen2-MoE / GLM-4.5 sparse ones, which differ
only in config flags (`glm_config.py` for the GLM families) and the feed-forward block, so they share one decoder;
anything else is a ValueError.
"""

from slime.engine.models.decoder import DecoderForCausalLM
from slime.engine.models.model_config import SUPPORTED_MODEL_TYPES, ModelConfig, load_model_config

__all__ = ["DecoderForCausalLM", "ModelConfig", "SUPPORTED_MODEL_TYPES", "load_model_config"]
