"""The CLI: slime's flag names, derived fields, and a clear error for every bad combination."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from slime.config.arguments import parse_args
from slime.config.errors import ArgumentError

REPO = Path(__file__).resolve().parents[2]
QWEN3_06B_CONFIG = {
    "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 28, "hidden_size": 1024,
    "intermediate_size": 3072, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "rope_theta": 1000000, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "max_position_embeddings": 40960,
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("args")
    model = root / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN3_06B_CONFIG))
    data = root / "data.jsonl"
    data.write_text('{"input": "1+1", "label": "2"}\n')
    return model, data


def base(setup, *extra):
    model, data = setup
    return ["--hf-checkpoint", str(model), "--prompt-data", str(data), "--rollout-batch-size", "4",
            "--n-samples-per-prompt", "4", "--num-rollout", "2", "--rm-type", "math", *extra]


def test_derived_fields(setup):
    args = parse_args(base(setup, "--actor-num-gpus-per-node", "2", "--num-steps-per-rollout", "2",
                           "--sglang-context-length", "2048", "--sglang-mem-fraction-static", "0.5"))
    assert args.global_batch_size == 8 and args.num_steps_per_rollout == 2
    assert args.world_size == 2 and args.rollout_num_engines == 1
    assert args.eps_clip_high == args.eps_clip == 0.2
    assert args.engine_config == {"max_model_len": 2048, "gpu_memory_utilization": 0.5}
    assert args.over_sampling_batch_size == 4 and not args.use_critic
    assert args.loss_agg_mode == "sample_mean" and args.loss_agg_constant is None


@pytest.mark.parametrize("flags, expected", [
    (["--sglang-disable-overlap-schedule"], {"overlap_schedule": False}),
    (["--sglang-disable-overlap-schedule=false"], {"overlap_schedule": True}),
    (["--sglang-disable-cuda-graph"], {"enforce_eager": True}),
    (["--sglang-piecewise-cuda-graph-max-tokens", "2048"], {"prefill_cuda_graph_max_tokens": 2048}),
    (["--sglang-cuda-graph-max-bs-prefill", "512"], {"prefill_cuda_graph_max_tokens": 512}),
    (["--sglang-kv-cache-dtype", "fp8_e4m3"], {"kv_cache_dtype": "fp8_e4m3"}),
])
def test_sglang_switches_map_onto_engine_config(setup, flags, expected):
    assert parse_args(base(setup, *flags)).engine_config == expected


def test_fp4_kv_cache_is_refused_for_the_built_in_engine_only(setup):
    with pytest.raises(ArgumentError, match="--sglang-kv-cache-dtype fp4_e2m1: .*fp4 needs --rollout-backend sglang"):
        parse_args(base(setup, "--sglang-kv-cache-dtype", "fp4_e2m1"))
    assert parse_args(base(setup, "--sglang-kv-cache-dtype", "fp4_e2m1", "--rollout-backend", "sglang")).engine_config \
        == {"kv_cache_dtype": "fp4_e2m1"}  # SGLang gets the flag itself; the built-in engine's config is not used


def test_algorithm_derived_fields(setup):
    args = parse_args(base(setup, "--advantage-estimator", "ppo", "--lr", "1e-6", "--loss-agg-mode", "constant",
                           "--rollout-max-response-len", "64"))
    assert args.use_critic and args.critic_lr == 1e-6
    assert args.loss_agg_mode == "constant" and args.loss_agg_constant == 64.0  # Dr.GRPO: the max response length
    per_token = parse_args(base(setup, "--calculate-per-token-loss"))
    assert per_token.loss_agg_mode == "token_mean"
    assert parse_args(base(setup, "--loss-agg-mode", "token_mean")).calculate_per_token_loss


def test_engines_of_several_devices_stay_on_the_built_in_engine(setup):
    """slime's recipes set --rollout-num-gpus-per-engine 2 or 8 and no backend: the built-in engine runs each engine
    as that many ranks (tp_size), and --rollout-backend sglang still picks SGLang."""
    assert parse_args(base(setup)).rollout_backend == "slime"
    args = parse_args(base(setup, "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2"))
    assert (args.rollout_backend, args.rollout_num_engines) == ("slime", 2)
    sglang = parse_args(base(setup, "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2",
                             "--rollout-backend", "sglang"))
    assert (sglang.rollout_backend, sglang.rollout_num_engines) == ("sglang", 2)


def test_megatron_hook_aliases(setup):
    init, step = "slime.utils.misc.seed_everything", "slime.utils.misc.find_free_port"  # any importable function
    args = parse_args(base(setup, "--custom-megatron-init-path", init, "--custom-megatron-before-train-step-hook-path",
                           step))
    assert args.custom_init_path == init and args.custom_before_train_step_hook_path == step


@pytest.mark.parametrize("extra, message", [
    (["--global-batch-size", "5"], "--global-batch-size"),
    (["--global-batch-size", "8", "--num-steps-per-rollout", "3"], "--num-steps-per-rollout"),
    (["--use-kl-loss", "--kl-loss-coef", "0.1"], "--ref-load"),
    (["--save-interval", "2"], "--save"),
    (["--eval-interval", "2"], "--eval-prompt-data"),
    (["--rollout-temperature", "0"], "--rollout-temperature"),
    (["--num-layers", "3"], "num_hidden_layers"),
    (["--hidden-size", "512"], "hidden_size"),
    (["--sglang-enable-foo"], "--sglang-enable-foo"),
    (["--sglang-context-length", "abc"], "--sglang-context-length"),
    (["--not-a-flag"], "--not-a-flag"),
    (["--over-sampling-batch-size", "2"], "--over-sampling-batch-size"),
    (["--use-dynamic-batch-size"], "--max-tokens-per-gpu"),
    (["--advantage-estimator", "reinforce_plus_plus"], "--normalize-advantages"),
    (["--eps-clip-c", "0.5"], "--eps-clip-c"),
    (["--loss-type", "custom_loss"], "--custom-loss-function-path"),
    (["--actor-num-gpus-per-node", "3"], "--global-batch-size"),
    (["--use-tis", "--use-rollout-logprobs"], "--use-tis"),
    (["--use-opd"], "--opd-teacher-load"),
    (["--tis-mode", "mask_token"], "--use-tis"),
    (["--calculate-per-token-loss", "--loss-agg-mode", "constant"], "--calculate-per-token-loss"),
    (["--loss-agg-constant", "8"], "--loss-agg-mode constant"),
    (["--loss-agg-mode", "constant", "--loss-agg-constant", "0"], "--loss-agg-constant"),
    (["--num-critic-only-steps", "-1"], "--num-critic-only-steps"),
])
def test_bad_flags_name_the_flag(setup, extra, message):
    with pytest.raises(ArgumentError, match=message.replace("+", r"\+")):
        parse_args(base(setup, *extra))


def test_kl_in_reward_and_loss_exclude_each_other(setup):
    model, _ = setup
    with pytest.raises(ArgumentError, match="exclude"):
        parse_args(base(setup, "--ref-load", str(model), "--kl-coef", "0.1", "--use-kl-loss", "--kl-loss-coef", "0.1"))


def test_missing_files_are_named(setup, tmp_path):
    with pytest.raises(ArgumentError, match="--hf-checkpoint"):
        parse_args(["--hf-checkpoint", str(tmp_path), "--rollout-batch-size", "1", "--num-rollout", "1",
                    "--rm-type", "math"])
    model, _ = setup
    with pytest.raises(ArgumentError, match="--prompt-data"):
        parse_args(["--hf-checkpoint", str(model), "--prompt-data", str(tmp_path / "nope.jsonl"),
                    "--rollout-batch-size", "1", "--num-rollout", "1", "--rm-type", "math"])


def test_train_py_reports_bad_flags_without_traceback(setup):
    result = subprocess.run([sys.executable, str(REPO / "train.py"), *base(setup, "--save-interval", "2")],
                            capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 2
    assert "--save-interval needs --save" in result.stderr and "Traceback" not in result.stderr


def test_a_reward_source_is_required_and_a_custom_generate_function_counts(setup):
    """Without --rm-type / --custom-rm-path the run is refused at start-up; a custom generate function may grade its
    own samples (slime's agent examples do), so it counts as a reward source."""
    without_rm = [a for a in base(setup) if a not in ("--rm-type", "math")]
    with pytest.raises(ArgumentError, match="no reward: pass --rm-type"):
        parse_args(without_rm)
    args = parse_args([*without_rm, "--custom-generate-function-path", "examples.coding_agent_rl.generate.generate"])
    assert args.rm_type is None and args.custom_rm_path is None
