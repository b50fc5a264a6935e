"""A tensor / expert parallel layout the model cannot be split over is refused when the model (or the runner) is
built, with an error naming --tp-size / --ep-size, the engine Config field and the checkpoint's config field; at
tp_size 1 the model keeps the one-device parameter names and shapes."""

from dataclasses import replace

import pytest
import torch

from slime.engine.config import Config
from slime.engine.model_runner import ModelRunner
from slime.engine.models import DecoderForCausalLM, load_model_config
from slime.engine.parallel.state import ParallelState
from slime.utils.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    """The tiny Qwen3 (4 q / 2 kv heads, intermediate 128) and Qwen3-MoE (8 experts of intermediate 32)."""
    paths = {arch: build_tiny_model(tmp_path_factory.mktemp(arch), arch=arch) for arch in ("qwen3", "qwen3_moe")}
    return {arch: (path, load_model_config(str(path))) for arch, path in paths.items()}


REFUSED = [
    ("qwen3", {}, 3, 1, r"num_attention_heads \(4\) is not divisible by --tp-size 3 \(engine Config.tp_size\)"),
    ("qwen3", dict(num_attention_heads=6, num_key_value_heads=3), 2, 1,
     r"num_key_value_heads \(3\) is not divisible by --tp-size 2"),
    ("qwen3", dict(num_attention_heads=8, num_key_value_heads=3), 8, 1,
     r"--tp-size 8 \(engine Config.tp_size\) is not a multiple of num_key_value_heads \(3\)"),
    ("qwen3", dict(intermediate_size=130), 4, 1, r"intermediate_size \(130\) is not divisible by --tp-size 4"),
    ("qwen3", {}, 2, 2, r"--ep-size 2 \(engine Config.ep_size\) splits MoE experts, but this qwen3 model is dense"),
    ("qwen3_moe", dict(num_experts=6), 4, 4,
     r"num_experts \(6\) is not divisible by --ep-size 4 \(engine Config.ep_size"),
    ("qwen3_moe", dict(moe_intermediate_size=30), 4, 1,
     r"moe_intermediate_size \(30\) is not divisible by --tp-size 4 / --ep-size 1 = 4"),
    ("qwen3_moe", dict(moe_intermediate_size=30), 4, 2, None),  # 2 ranks share each expert block: 30 / 2 splits
]


@pytest.mark.parametrize("arch, overrides, tp_size, ep_size, message", REFUSED)
def test_a_layout_that_does_not_divide_is_refused(configs, arch, overrides, tp_size, ep_size, message):
    config = replace(configs[arch][1], **overrides)
    for rank in (0, tp_size - 1):
        parallel = ParallelState(rank, tp_size, ep_size)
        if message is None:
            DecoderForCausalLM(config, parallel)
            continue
        with pytest.raises(ValueError, match=message):
            DecoderForCausalLM(config, parallel)


def test_the_runner_refuses_before_loading_anything(configs):
    path, model_config = configs["qwen3"]
    config = Config(model=str(path), device="cpu", num_kvcache_blocks=8)
    with pytest.raises(ValueError, match=r"--tp-size 3"):
        ModelRunner(config, model_config, set(), ParallelState(0, 3))


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_one_rank_keeps_the_single_device_parameters(configs, arch):
    _, config = configs[arch]
    shapes = {name: tuple(param.shape) for name, param in DecoderForCausalLM(config).named_parameters()}
    head_dim, hidden = config.head_dim, config.hidden_size
    qkv_rows = (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim
    assert shapes["model.embed_tokens.weight"] == (config.vocab_size, hidden)
    assert shapes["model.layers.0.self_attn.qkv_proj.weight"] == (qkv_rows, hidden)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (config.num_attention_heads * head_dim, hidden)[::-1]
    if arch == "qwen3":
        assert shapes["model.layers.0.mlp.gate_up_proj.weight"] == (2 * config.intermediate_size, hidden)
        assert shapes["model.layers.0.mlp.down_proj.weight"] == (hidden, config.intermediate_size)
    else:
        experts = (config.num_experts, 2 * config.moe_intermediate_size, hidden)
        assert shapes["model.layers.0.mlp.experts.gate_up_proj"] == experts
        assert shapes["model.layers.0.mlp.gate.weight"] == (config.num_experts, hidden)
    layer = DecoderForCausalLM(config).model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, torch.nn.Linear) and isinstance(layer.self_attn.o_proj, torch.nn.Linear)
