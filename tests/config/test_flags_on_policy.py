"""--true-on-policy-mode and --deterministic-mode at parse time: a covered configuration turns the engine's
batch-invariant forward on; every configuration the modes cannot cover is refused by name, before anything starts."""

import json

import pytest

from slime.config.arguments import parse_args
from slime.config.errors import ArgumentError
from slime.utils.tiny_model import tiny_config


def checkpoint(tmp_path, model_type: str = "qwen3"):
    folder = tmp_path / model_type
    folder.mkdir(exist_ok=True)
    config = tiny_config(model_type).to_dict() if model_type == "qwen3_moe" else {"model_type": model_type}
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def parse(tmp_path, *flags, model_type: str = "qwen3"):
    return parse_args(["--hf-checkpoint", checkpoint(tmp_path, model_type), "--rollout-batch-size", "2",
                       "--num-rollout", "1", "--rm-type", "math", *flags])


@pytest.mark.parametrize("mode", ["--true-on-policy-mode", "--deterministic-mode"])
def test_a_covered_run_turns_the_engines_batch_invariant_forward_on(tmp_path, mode):
    args = parse(tmp_path, mode)
    assert args.engine_config["true_on_policy"] is True
    assert "true_on_policy" not in parse(tmp_path).engine_config


@pytest.mark.parametrize(("flags", "named"), [
    (["--rollout-num-gpus-per-engine", "2", "--rollout-num-gpus", "2"], "--rollout-num-gpus-per-engine 2"),
    (["--lora-rank", "4", "--target-modules", "all-linear", "--lora-dropout", "0.1"], "--lora-dropout 0.1"),
    (["--lora-rank", "4", "--target-modules", "all-linear", "--lora-adapter-key", "task", "--lora-adapter-names",
      "a,b"], "--lora-adapter-names"),
    (["--compile-model"], "--compile-model"),
    (["--recompute-activations"], "--recompute-activations"),
    (["--partial-rollout"], "--mask-offpolicy-in-partial-rollout"),
    (["--train-backend", "megatron", "--tensor-model-parallel-size", "2", "--actor-num-gpus-per-node", "2"],
     "--tensor-model-parallel-size 2"),
    (["--train-backend", "megatron", "--pipeline-model-parallel-size", "2", "--actor-num-gpus-per-node", "2"],
     "--pipeline-model-parallel-size 2"),
])
def test_uncovered_configurations_are_refused_by_name(tmp_path, flags, named):
    if "megatron" in flags:
        pytest.importorskip("megatron.core")
    with pytest.raises(ArgumentError, match="--true-on-policy-mode") as error:
        parse(tmp_path, "--true-on-policy-mode", *flags)
    assert named in str(error.value)


def test_a_moe_run_with_rollout_routing_replay_is_covered_on_fsdp(tmp_path):
    args = parse(tmp_path, "--true-on-policy-mode", "--use-rollout-routing-replay", model_type="qwen3_moe")
    assert args.engine_config["true_on_policy"] is True


@pytest.mark.parametrize(("flags", "named"), [
    (["--use-routing-replay"], "--use-routing-replay"),
    (["--use-rollout-routing-replay", "--moe-aux-loss-coeff", "0.01"], "--moe-aux-loss-coeff"),
    (["--use-rollout-routing-replay", "--moe-router-dtype", "fp32"], "--moe-router-dtype"),
])
def test_uncovered_moe_configurations_are_refused_by_name(tmp_path, flags, named):
    with pytest.raises(ArgumentError, match="--true-on-policy-mode does not cover") as error:
        parse(tmp_path, "--true-on-policy-mode", *flags, model_type="qwen3_moe")
    assert named in str(error.value)


def test_a_lora_run_on_fsdp_is_covered(tmp_path):
    args = parse(tmp_path, "--true-on-policy-mode", "--lora-rank", "4", "--target-modules", "all-linear")
    assert args.engine_config["true_on_policy"] is True


def test_lora_on_megatron_and_lora_on_a_moe_model_are_refused_by_name(tmp_path):
    with pytest.raises(ArgumentError, match="--lora-rank on a mixture-of-experts model"):
        parse(tmp_path, "--true-on-policy-mode", "--use-rollout-routing-replay", "--lora-rank", "4",
              "--target-modules", "q_proj,v_proj", model_type="qwen3_moe")
    pytest.importorskip("megatron.core")
    with pytest.raises(ArgumentError, match="--lora-rank on the megatron backend"):
        parse(tmp_path, "--true-on-policy-mode", "--train-backend", "megatron", "--lora-rank", "4",
              "--target-modules", "all-linear")


def test_a_moe_run_on_megatron_is_refused_by_name(tmp_path):
    pytest.importorskip("megatron.core")
    with pytest.raises(ArgumentError, match="mixture-of-experts model on the Megatron backend"):
        parse(tmp_path, "--true-on-policy-mode", "--train-backend", "megatron", model_type="qwen3_moe")


@pytest.mark.parametrize("model_type", ["qwen2_moe", "glm4", "glm4_moe", "deepseek_v3", "kimi_k2",
                                        "qwen2_5_vl", "qwen3_vl"])
def test_uncovered_model_families_are_refused_by_name(tmp_path, model_type):
    for mode in ("--true-on-policy-mode", "--deterministic-mode"):
        with pytest.raises(ArgumentError, match=f"{mode} does not cover model_type '{model_type}'"):
            parse(tmp_path, mode, model_type=model_type)


@pytest.mark.parametrize(("flags", "named"), [
    (["--over-sampling-batch-size", "4"], "--over-sampling-batch-size 4"),
    (["--dynamic-sampling-filter-path",
      "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std"], "--dynamic-sampling-filter-path"),
    (["--partial-rollout", "--mask-offpolicy-in-partial-rollout"], "--partial-rollout"),
])
def test_deterministic_mode_refuses_timing_dependent_sample_selection(tmp_path, flags, named):
    with pytest.raises(ArgumentError, match="--deterministic-mode does not cover") as error:
        parse(tmp_path, "--deterministic-mode", *flags)
    assert named in str(error.value)
