"""Parse-time rules and the file formats of slime's trainer-side and debug flags: the flags' combinations
(validate_trainer_flags.py), --megatron-config-path's YAML, --dump-details' paths, the rollout dumps slime writes
(torch.save) and this project's (.json) with --load-debug-rollout-data-subsample, and the forge rollout function."""

from __future__ import annotations

import json

import pytest
import torch

from slime.config.arguments import parse_args
from slime.config.errors import ArgumentError
from slime.utils.debug_dump import load_samples, save_samples
from slime.utils.types import Sample
from tests.helpers import args_helpers

CONFIG = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64,
          "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "vocab_size": 300, "rope_theta": 10000, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
          "max_position_embeddings": 512}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rules") / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    return folder


def parse(model, *extra):
    return parse_args(["--hf-checkpoint", str(model), "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
                       "--num-rollout", "2", "--rm-type", "math", *map(str, extra)])


@pytest.mark.parametrize("extra, message", [
    (["--freeze-params-name-list", "a", "--only-train-params-name-list", "b"], "pass only one of"),
    (["--freeze-params-name-list", "layers.(0"], r"--freeze-params-name-list 'layers.\(0': not a Python regular"),
    (["--custom-pg-loss-reducer-function-path", "json.dumps", "--loss-agg-mode", "constant",
      "--loss-agg-constant", "8"], "use it with --loss-agg-mode sample_mean or token_mean"),
    (["--custom-pg-loss-reducer-function-path", "no_such_module.fn"], "--custom-pg-loss-reducer-function-path"),
    (["--use-stateless-adam"], "pass --no-save-optim too"),
    (["--log-probs-max-tokens-per-gpu", "4096"], "pass that flag too"),
    (["--custom-model-provider-path", "json.dumps"], "--custom-model-provider-path is a Megatron-backend feature"),
    (["--megatron-config-path", "x.yaml"], "--megatron-config-path is a Megatron-backend feature"),
    (["--ref-ckpt-step", "3"], "--ref-ckpt-step picks a checkpoint step of --ref-load"),
    (["--load-debug-rollout-data-subsample", "0.5"], "pass both"),
    (["--load-forge-rollout-data", "d/0.pt"], "--rollout-function-path slime.rollout.forge_load.generate_rollout"),
    (["--save-debug-train-data", "same_{rollout_id}.pt", "--save-debug-rollout-data", "same_{rollout_id}.pt"],
     "must differ from --save-debug-rollout-data"),
])
def test_bad_combinations_name_the_flag(model, extra, message):
    with pytest.raises(ArgumentError, match=message):
        parse(model, *extra)


def test_routing_replay_needs_the_train_micro_batches_for_log_probs(tmp_path):
    moe = tmp_path / "moe"
    moe.mkdir()
    (moe / "config.json").write_text(json.dumps({**CONFIG, "model_type": "qwen3_moe", "num_experts": 4,
                                                 "num_experts_per_tok": 2, "moe_intermediate_size": 32}))
    with pytest.raises(ArgumentError, match="drop --log-probs-max-tokens-per-gpu"):
        parse(moe, "--use-dynamic-batch-size", "--max-tokens-per-gpu", "64", "--log-probs-max-tokens-per-gpu",
              "256", "--use-routing-replay")


@pytest.mark.parametrize("load, step", [("--ref-load", "--ref-ckpt-step"),
                                        ("--opd-teacher-load", "--opd-teacher-ckpt-step")])
def test_ckpt_steps_name_the_missing_or_incomplete_step(model, tmp_path, load, step):
    (tmp_path / "rollout_2").mkdir()
    extra = ("--use-opd", "--opd-type", "megatron") if load == "--opd-teacher-load" else ()
    with pytest.raises(ArgumentError, match=rf"{step} 5: .* has no checkpoint rollout_5 \(it has: rollout_2"):
        parse(model, load, tmp_path, step, "5", *extra)
    with pytest.raises(ArgumentError, match=rf"{step} 2: checkpoint .*rollout_2 is incomplete"):
        parse(model, load, tmp_path, step, "2", *extra)


def test_dump_details_and_the_log_probs_budget_default(model, tmp_path):
    args = parse(model, "--dump-details", tmp_path, "--use-dynamic-batch-size", "--max-tokens-per-gpu", "512")
    assert args.save_debug_rollout_data == f"{tmp_path}/rollout_data/{{rollout_id}}.pt"
    assert args.save_debug_train_data == f"{tmp_path}/train_data/{{rollout_id}}.pt"
    assert args.log_probs_max_tokens_per_gpu == 512  # slime's default: the train budget


def test_megatron_config_path_gives_the_actor_its_overrides(model, tmp_path):
    from slime.config.megatron_role_config import role_args

    config = tmp_path / "megatron.yaml"
    config.write_text("megatron:\n  - name: default\n    role: actor\n    overrides:\n      lr: 1e-2\n"
                      "      num_gpus_per_node: 8\n      recompute_granularity: full\n")
    args = parse(model, "--train-backend", "megatron", "--megatron-config-path", config)
    actor = role_args(args, "actor")
    assert (actor.lr, actor.recompute_granularity) == (0.01, "full")  # YAML's "1e-2" string became a float
    assert (args.lr, args.recompute_granularity) == (1e-6, None)  # the driver keeps the command line's


def test_megatron_config_critic_entry_sets_the_critics_learning_rate(model, tmp_path):
    from slime.config.megatron_role_config import role_args

    config = tmp_path / "megatron.yaml"
    config.write_text("megatron:\n  - {name: default, role: critic, overrides: {lr: 1e-5}}\n")
    argv = ("--train-backend", "megatron", "--advantage-estimator", "ppo", "--megatron-config-path", config)
    args = parse(model, *argv)
    assert (args.lr, args.critic_lr) == (1e-6, 1e-6)  # --critic-lr defaults to --lr
    assert (role_args(args, "critic").critic_lr, role_args(args, "actor").critic_lr) == (1e-5, 1e-6)
    config.write_text("megatron:\n  - {name: default, role: critic, overrides: {tensor_model_parallel_size: 2}}\n")
    with pytest.raises(ArgumentError, match="give it on the command line"):  # checked at parse time under ppo
        parse(model, *argv)


@pytest.mark.parametrize("yaml_text, message", [
    ("actor: {lr: 1}\n", "needs a top-level 'megatron' list"),
    ("megatron:\n  - {role: actor, overrides: {no_such_flag: 1}}\n", "'no_such_flag' is not a flag"),
    ("megatron:\n  - {role: actor, overrides: {tensor_model_parallel_size: 2}}\n", "give it on the command line"),
    ("megatron:\n  - {role: actor}\n  - {role: actor}\n", "2 entries with role: actor"),
    ("megatron:\n  - {name: c, role: reward, overrides: {lr: 1}}\n", "use role: actor or role: critic"),
    ("megatron:\n  - {role: actor, overrides: {lr: fast}}\n", "lr: 'fast' is not a float"),
])
def test_bad_megatron_config_is_an_error(model, tmp_path, yaml_text, message):
    config = tmp_path / "megatron.yaml"
    config.write_text(yaml_text)
    with pytest.raises(ArgumentError, match=message):
        parse(model, "--train-backend", "megatron", "--megatron-config-path", config)


def _samples(count: int) -> list[Sample]:
    return [Sample(index=i, tokens=[1, 2, 3 + i], response_length=1, reward=float(i), loss_mask=[1],
                   status=Sample.Status.COMPLETED) for i in range(count)]


@pytest.mark.parametrize("name", ["dump.pt", "dump.json"])
def test_rollout_dumps_round_trip_and_subsample_as_slime(tmp_path, name):
    path = tmp_path / name
    save_samples(path, 3, _samples(7))
    assert [s.to_dict() for s in load_samples(path, "--load-debug-rollout-data")] == \
        [s.to_dict() for s in _samples(7)]
    # slime's subsample: int(7 * 0.5) = 3 samples, data[:3 // 2] + data[-3 // 2:] (the first one, the last two)
    assert [s.index for s in load_samples(path, "--load-debug-rollout-data", 0.5)] == [0, 5, 6]
    with pytest.raises(ValueError, match="keeps none of the 7 samples"):
        load_samples(path, "--load-debug-rollout-data", 0.1)


def test_a_dump_written_by_slime_loads(tmp_path):
    # slime's save_debug_rollout_data: torch.save({"rollout_id", "samples": [Sample.to_dict()]}) with its own keys
    row = {**_samples(1)[0].to_dict(), "a_field_of_newer_slime": 1}
    torch.save({"rollout_id": 0, "samples": [row]}, tmp_path / "0.pt")
    (loaded,) = load_samples(tmp_path / "0.pt", "--load-debug-rollout-data")
    assert loaded.tokens == [1, 2, 3] and loaded.a_field_of_newer_slime == 1
    (tmp_path / "bad.pt").write_text("not a dump")
    with pytest.raises(ValueError, match="bad.pt is not a rollout dump"):
        load_samples(tmp_path / "bad.pt", "--load-debug-rollout-data")


def test_forge_rollout_replays_dumps_with_slimes_path_rules(tmp_path):
    from slime.rollout.forge_load import generate_rollout

    save_samples(tmp_path / "0.pt", 0, _samples(4))
    save_samples(tmp_path / "eval_2.pt", 2, _samples(2))
    args = args_helpers.make_args(load_forge_rollout_data=str(tmp_path / "{rollout_id}.pt"))
    assert [s.index for s in generate_rollout(args, 3, None).samples] == [0, 1, 2, 3]  # falls back to rollout 0
    evaluated = generate_rollout(args, 2, None, evaluation=True).data["forge_eval"]
    assert evaluated["rewards"] == [0.0, 1.0] and evaluated["truncated"] == [False, False]
    assert generate_rollout(args, 1, None, evaluation=True).data == {}  # eval never falls back
    literal = args_helpers.make_args(load_forge_rollout_data=str(tmp_path / "0.pt"))
    assert len(generate_rollout(literal, 9, None).samples) == 4
    assert generate_rollout(literal, 9, None, evaluation=True).data == {}
    missing = args_helpers.make_args(load_forge_rollout_data=str(tmp_path / "none_{rollout_id}.pt"))
    with pytest.raises(ValueError, match="no dump for rollout 1"):
        generate_rollout(missing, 1, None)


def _slime_fwd_flops(length: int, config: dict, ffn: int) -> float:
    """slime's flops_utils.calculate_fwd_flops for one sequence of a model whose every layer has MLP width `ffn`."""
    h, heads, groups, kv = (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"],
                            config["head_dim"])
    qkv = 2 * length * h * heads * kv + 2 * 2 * length * h * groups * kv
    attention = 2 * heads * length * length * kv / 2 + heads * length * length * kv
    layer = qkv + attention + 2 * length * h * h + 2 * length * h * ffn * 3
    return layer * config["num_hidden_layers"] + 2 * length * h * config["vocab_size"]


@pytest.mark.parametrize("moe", [False, True])
def test_flops_cost_model_is_proportional_to_slimes_flops(moe):
    from slime.utils.flops_balance import linear_coefficient, workloads

    config = dict(CONFIG)
    ffn = config["intermediate_size"]
    if moe:
        config.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48)
        ffn = 48 * 2
    lengths = [1, 37, 512, 4096]
    costs = workloads(lengths, linear_coefficient(config))
    flops = [_slime_fwd_flops(length, config, ffn) for length in lengths]
    assert [c / costs[0] for c in costs] == pytest.approx([f / flops[0] for f in flops], rel=1e-9)


def test_balance_by_flops_splits_ranks_and_micro_batches_by_flops(model):
    from slime.backends.packing import split_micro_batches
    from slime.ray.train_data import split_train_data
    from slime.utils.flops_balance import balanced_micro_batches, linear_coefficient, workloads

    lengths = [9000, 5000, 5000, 4000, 3000, 3000]  # long enough for attention's L^2 to dominate
    data = {"tokens": [[1] * n for n in lengths], "sample_indices": list(range(6))}
    common = ("--actor-num-gpus-per-node", 2, "--use-dynamic-batch-size", "--max-tokens-per-gpu", 12000)
    by_tokens = split_train_data(parse(model, *common, "--balance-data"), data, 0)[0]
    by_flops = split_train_data(parse(model, *common, "--balance-by-flops"), data, 0)[0]
    assert [rank["sample_indices"] for rank in by_tokens] == [[0, 3, 5], [1, 2, 4]]  # 16000 / 13000 tokens
    assert [rank["sample_indices"] for rank in by_flops] == [[0, 4, 5], [1, 2, 3]]
    coefficient = linear_coefficient(CONFIG)

    def spread(parts):
        loads = [sum(workloads([lengths[i] for i in part], coefficient)) for part in parts]
        return max(loads) - min(loads)

    assert spread([r["sample_indices"] for r in by_flops]) < spread([r["sample_indices"] for r in by_tokens])
    bins = balanced_micro_batches(list(range(6)), lengths, 12000, coefficient)
    assert bins == [[0], [1, 3], [2, 4, 5]]  # ceil(29000 / 12000) = 3 bins, largest workload first
    first_fit = split_micro_batches(list(range(6)), lengths, 1, 12000)
    assert first_fit == [[0, 4], [1, 2], [3, 5]] and spread(bins) < spread(first_fit)
    assert balanced_micro_batches([0, 1], lengths, 4000, coefficient) == [[0], [1]]  # more bins than samples
