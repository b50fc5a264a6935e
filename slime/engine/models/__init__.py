"""Model implementations the engine runs: `load_model_config(model_path)` reads config.json and
`DecoderForCausalLM(config)` builds the module (weights not loaded). Supported (`SUPPORTED_MODEL_TYPES`): Qwen2 /
Qwen2.5, Qwen3 and Llama 3 dense decoders, the Qwen3-MoE / Qwen2-MoE sparse ones, GLM-4 / GLM-4.5 and the
DeepSeek-V3 family (multi-head latent attention), which differ in config flags, the attention module and the
feed-forward block, so they share one decoder; the vision-language Qwen2.5-VL and Qwen3-VL wrap that decoder with
their vision tower (`vl_model.py`); anything else is a ValueError.
"""

from slime.engine.models.decoder import DecoderForCausalLM
from slime.engine.models.model_config import SUPPORTED_MODEL_TYPES, ModelConfig, load_model_config

__all__ = ["DecoderForCausalLM", "ModelConfig", "SUPPORTED_MODEL_TYPES", "load_model_config"]
