"""The transformers config the Megatron backend and its converters build a model from: --hf-checkpoint's config.json
through `AutoConfig`, but Kimi K2's, whose model_type "kimi_k2" (its own remote code over DeepseekV3ForCausalLM)
transformers does not know, read as the DeepseekV3Config it is. A quantized checkpoint (DeepSeek's and Kimi's block
FP8) is refused with the conversion to run: the trainer's weights are its bf16 / fp32 copies.

Not the plain-JSON reading of config.json for flag checks (slime/utils/hf_config.py)."""

from __future__ import annotations

import json
from pathlib import Path


def read_hf_config(path: str | Path):
    from transformers import AutoConfig, DeepseekV3Config

    config_file = Path(path) / "config.json"
    raw = json.loads(config_file.read_text()) if config_file.is_file() else {}
    quantization = raw.get("quantization_config")
    if quantization:
        raise ValueError(f"--hf-checkpoint {path}: a quantized checkpoint (quantization_config.quant_method="
                         f"{quantization.get('quant_method')!r}) cannot be trained; convert it to bf16 first (slime's "
                         "tools/fp8_cast_bf16.py for block FP8) and drop quantization_config from its config.json")
    if raw.get("model_type") != "kimi_k2":
        return AutoConfig.from_pretrained(path)
    raw.pop("auto_map", None)  # remote-code classes: never imported
    return DeepseekV3Config.from_dict({**raw, "model_type": "deepseek_v3"})
