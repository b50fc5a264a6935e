"""The transformers config the Megatron backend builds its model from: `AutoConfig` of the checkpoint, except Kimi K2,
whose config.json says model_type "kimi_k2" (its own remote code) over DeepseekV3ForCausalLM, a type transformers
does not know: read as the DeepseekV3Config it is (remote code never imported). A quantized checkpoint (DeepSeek's
and Kimi's block FP8) is refused: the trainer keeps master weights of a bf16 checkpoint.

Not the model's construction (model.py, family_config.py).
"""

from __future__ import annotations

import json
from pathlib import Path


def load_hf_config(path: str | Path):
    from transformers import AutoConfig, DeepseekV3Config

    config_file = Path(path) / "config.json"
    raw = json.loads(config_file.read_text()) if config_file.is_file() else {}
    quantization = raw.get("quantization_config")
    if quantization:
        raise ValueError(f"--hf-checkpoint {path}: a quantized checkpoint (quantization_config.quant_method="
                         f"{quantization.get('quant_method')!r}) cannot be trained; convert it to bf16 first "
                         "(block FP8: python tools/fp8_cast_bf16.py), with config.json without quantization_config")
    if raw.get("model_type") != "kimi_k2":
        return AutoConfig.from_pretrained(path)
    raw.pop("auto_map", None)
    raw["model_type"] = "deepseek_v3"
    return DeepseekV3Config.from_dict(raw)
