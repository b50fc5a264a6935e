"""The config the Megatron backend and its converters build from: Kimi K2's `kimi_k2` config.json read as the
DeepseekV3Config it is (same fields), any other through AutoConfig; a quantized checkpoint refused naming the
conversion."""

from __future__ import annotations

import json

import pytest

from slime.backends.megatron_utils.hf_config import read_hf_config


def _write(folder, config: dict):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


KIMI = {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 3,
        "hidden_size": 64, "n_routed_experts": 8, "routed_scaling_factor": 2.827, "kv_lora_rank": 16,
        "q_lora_rank": 32, "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}}


def test_kimi_k2_reads_as_deepseek_v3_with_its_fields(tmp_path):
    config = read_hf_config(_write(tmp_path / "kimi", KIMI))
    assert type(config).__name__ == "DeepseekV3Config" and config.model_type == "deepseek_v3"
    assert (config.num_hidden_layers, config.n_routed_experts, config.routed_scaling_factor) == (3, 8, 2.827)
    assert (config.kv_lora_rank, config.q_lora_rank) == (16, 32)
    plain = {key: value for key, value in KIMI.items() if key != "auto_map"}
    deepseek = read_hf_config(_write(tmp_path / "v3", {**plain, "model_type": "deepseek_v3"})).to_dict()
    assert {k: v for k, v in deepseek.items() if k != "_name_or_path"} == {
        k: v for k, v in config.to_dict().items() if k != "_name_or_path"}


def test_a_quantized_checkpoint_is_refused_naming_the_conversion(tmp_path):
    folder = _write(tmp_path / "fp8", {**KIMI, "quantization_config": {"quant_method": "fp8",
                                                                        "weight_block_size": [128, 128]}})
    with pytest.raises(ValueError, match="quant_method='fp8'.*convert it to bf16 first.*fp8_cast_bf16"):
        read_hf_config(folder)
