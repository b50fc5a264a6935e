"""What the engine's true_on_policy refuses when it starts: sharded engines, an fp8 KV cache, and models outside the
batch-invariant decoder (named by family or config field); Qwen3-MoE (with routed-expert recording, for R3) and LoRA
serving are covered."""

import pytest

from slime.engine.config import Config
from slime.engine.engine import Engine
from slime.engine.models.model_config import parse_model_config
from slime.engine.true_on_policy.contract import decoder_spec
from slime.utils.tiny_model import build_tiny_model, tiny_config


@pytest.mark.parametrize(("fields", "named"), [
    ({"tp_size": 2}, "tp_size 2"),
    ({"kv_cache_dtype": "fp8_e4m3"}, "kv_cache_dtype"),
    ({"overlap_schedule": True}, "overlap_schedule"),
])
def test_engine_layouts_outside_the_mode_are_refused(fields, named):
    with pytest.raises(ValueError, match="true_on_policy") as error:
        Config(model="m", true_on_policy=True, **fields)
    assert named in str(error.value)


def raw_config(arch: str, **overrides) -> dict:
    return tiny_config(arch, **overrides).to_dict()


@pytest.mark.parametrize("arch", ["qwen2_moe", "glm4", "glm4_moe"])
def test_uncovered_families_are_refused_by_model_type(arch):
    with pytest.raises(ValueError, match=f"does not cover model_type '{arch}'"):
        decoder_spec(parse_model_config(raw_config(arch)))


def test_llama3_rope_scaling_and_an_o_proj_bias_are_refused():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256}
    with pytest.raises(ValueError, match="rope_scaling"):
        decoder_spec(parse_model_config(raw_config("llama", rope_scaling=scaling)))
    with pytest.raises(ValueError, match="attention_bias"):
        decoder_spec(parse_model_config(raw_config("llama", attention_bias=True)))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama", "qwen3_moe"])
def test_covered_families_get_their_spec(arch):
    spec = decoder_spec(parse_model_config(raw_config(arch)))
    assert (spec.num_heads, spec.num_kv_heads, spec.qk_norm) == (4, 2, arch in ("qwen3", "qwen3_moe"))


def test_routed_expert_recording_and_lora_serving_are_covered():
    assert Config(model="m", true_on_policy=True, enable_return_routed_experts=True).enable_return_routed_experts
    assert Config(model="m", true_on_policy=True, enable_lora=True).enable_lora


def test_an_engine_on_an_uncovered_model_refuses_to_start(tmp_path):
    path = build_tiny_model(tmp_path / "moe", arch="qwen2_moe")
    with pytest.raises(ValueError, match="does not cover model_type 'qwen2_moe'"):
        Engine(str(path), device="cpu", num_kvcache_blocks=16, true_on_policy=True)
