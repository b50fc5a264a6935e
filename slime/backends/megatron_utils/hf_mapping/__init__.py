"""HF <-> Megatron weight names and layouts, one module per model family. Every mapping works on *full* Megatron
tensors (tensor-parallel shards concatenated, see tp_shards.py) under *global* names (layer and expert numbers of
the whole model, see names.py), so it knows nothing of parallelism:

- `to_megatron(name, read_hf, hf_config, padded_vocab) -> Tensor`: the full Megatron tensor `name`, built from the
  HF tensors that `read_hf(hf_name)` returns (embedding rows padded to `padded_vocab`);
- `to_hf(name, tensor, hf_config) -> list[(hf_name, Tensor)]`: the HF tensors of one full Megatron tensor.
"""

from __future__ import annotations

from types import ModuleType

from slime.backends.megatron_utils.hf_mapping import deepseek_v3, glm4, glm4_moe, llama_family, qwen3_moe

_FAMILIES = {"qwen2": llama_family, "qwen3": llama_family, "llama": llama_family, "qwen3_moe": qwen3_moe,
             "glm4": glm4, "glm4_moe": glm4_moe, "deepseek_v3": deepseek_v3, "glm4_moe_lite": deepseek_v3}


def mapping_for(hf_config) -> ModuleType:
    family = _FAMILIES.get(hf_config.model_type)
    if family is None:
        raise ValueError(f"no HF <-> Megatron mapping for model_type {hf_config.model_type!r}; "
                         f"supported: {', '.join(_FAMILIES)}")
    return family
