"""The MoE flags: a flag that disagrees with the checkpoint (or MoE flags on a dense model) is an error naming it,
Megatron's --moe-layer-freq forms are understood, and R3 turns on the engines' return_routed_experts. (The MoE
presets parse against their models in test_megatron_arguments.py.)"""

import json

import pytest

from slime.config.arguments import parse_args
from slime.config.errors import ArgumentError

QWEN3_30B_A3B_CONFIG = {
    "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 48,
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
    "rope_theta": 1000000, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "max_position_embeddings": 40960,
}
GLM45_AIR_CONFIG = {
    "model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"], "num_hidden_layers": 46, "hidden_size": 4096,
    "intermediate_size": 10944, "moe_intermediate_size": 1408, "n_routed_experts": 128, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
    "routed_scaling_factor": 1.0, "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151552, "partial_rotary_factor": 0.5, "attention_bias": True,
}
DENSE_CONFIG = {"model_type": "qwen3", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                "vocab_size": 512}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_args")
    for name, config in (("qwen3_moe", QWEN3_30B_A3B_CONFIG), ("glm4_moe", GLM45_AIR_CONFIG), ("dense", DENSE_CONFIG)):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
    (root / "data.jsonl").write_text('{"input": "1+1", "label": "2"}\n')
    return root


def parse(folders, model: str, *extra):
    return parse_args(["--hf-checkpoint", str(folders / model), "--prompt-data", str(folders / "data.jsonl"),
                       "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--num-rollout", "2",
                       "--rm-type", "math",
                       *extra])


@pytest.mark.parametrize("extra, message", [
    (["--moe-router-topk", "4"], "--moe-router-topk 4 does not match the checkpoint's 8"),
    (["--num-experts", "64"], "--num-experts 64 does not match"),
    (["--moe-layer-freq", "2"], "--moe-layer-freq 2 gives MoE layers"),
    (["--moe-layer-freq", "[1]*foo"], "--moe-layer-freq"),
    (["--moe-router-score-function", "sigmoid"], "routes by softmax"),
    (["--moe-aux-loss-coeff", "-1"], "--moe-aux-loss-coeff"),
])
def test_bad_moe_flags_name_the_flag(folders, extra, message):
    with pytest.raises(ValueError, match=message):
        parse(folders, "qwen3_moe", *extra)


@pytest.mark.parametrize("layer_freq", ["1", "([1]*48)", "'([1]*48)'", "[" + ", ".join(["1"] * 48) + "]"])
def test_megatron_layer_freq_forms(folders, layer_freq):
    assert parse(folders, "qwen3_moe", "--moe-layer-freq", layer_freq).moe_layer_freq == layer_freq


def test_moe_flags_on_a_dense_model_are_errors(folders):
    for flag in (["--use-rollout-routing-replay"], ["--use-routing-replay"], ["--num-experts", "8"]):
        with pytest.raises(ArgumentError, match="not a mixture-of-experts model"):
            parse(folders, "dense", *flag)


def test_r3_asks_the_engines_for_their_routing(folders):
    assert parse(folders, "qwen3_moe", "--use-rollout-routing-replay").engine_config["enable_return_routed_experts"]
    assert "enable_return_routed_experts" not in parse(folders, "qwen3_moe").engine_config


# slime's glm4.5-106B-A12B preset's MoE flags (scripts/models/glm4.5-106B-A12B.sh @624b824)
GLM45_AIR_FLAGS = ["--num-experts", "128", "--moe-router-topk", "8", "--moe-ffn-hidden-size", "1408",
                   "--moe-shared-expert-intermediate-size", "1408", "--moe-layer-freq", "[0]*1+[1]*45",
                   "--moe-router-score-function", "sigmoid"]


def test_glm45_preset_flags_match_the_checkpoint(folders):
    args = parse(folders, "glm4_moe", *GLM45_AIR_FLAGS, "--use-rollout-routing-replay")
    assert args.moe_router_score_function == "sigmoid" and args.engine_config["enable_return_routed_experts"]


@pytest.mark.parametrize("change, message", [
    (("--moe-router-score-function", "softmax"), "routes by sigmoid"),
    (("--moe-shared-expert-intermediate-size", "2816"), "does not match the checkpoint's 1408"),
    (("--moe-layer-freq", "1"), "--moe-layer-freq 1 gives MoE layers"),  # the leading dense layer
])
def test_glm45_flags_that_disagree_are_named(folders, change, message):
    flags = list(GLM45_AIR_FLAGS)
    if change[0] in flags:
        index = flags.index(change[0])
        flags[index: index + 2] = change
    with pytest.raises(ValueError, match=message):
        parse(folders, "glm4_moe", *flags)
