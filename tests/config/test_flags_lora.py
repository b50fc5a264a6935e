"""The LoRA flags: --target-modules in HF or Megatron spelling resolves to HF leaf names, and every configuration
the LoRA path cannot cover is an error naming the flag (no rank, MoE experts, fused layers half-targeted on
Megatron, a PEFT folder of another rank, the freezing flags, dropout at TP > 1)."""

import json

import pytest

from slime.config.errors import ArgumentError
from slime.config.flags_lora import resolve_target_modules
from tests.config.test_flags_moe import DENSE_CONFIG, QWEN3_30B_A3B_CONFIG
from tests.helpers.args_helpers import make_args
from tests.helpers.megatron_arg_helpers import base, data  # noqa: F401 (data: a fixture)

ALL = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def test_target_modules_resolve_to_hf_leaf_names():
    assert resolve_target_modules("all-linear", None, DENSE_CONFIG) == ALL
    assert resolve_target_modules("linear_qkv,o_proj", None, DENSE_CONFIG) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert resolve_target_modules("all-linear", "linear_fc1,down_proj", DENSE_CONFIG) == ["k_proj", "o_proj",
                                                                                          "q_proj", "v_proj"]
    assert resolve_target_modules("model.layers.0.self_attn.q_proj", None, DENSE_CONFIG) == ["q_proj"]


@pytest.mark.parametrize("targets, exclude, config, message", [
    ("qkv", None, DENSE_CONFIG, "--target-modules: 'qkv' is not a layer"),
    ("all-linear,q_proj", None, DENSE_CONFIG, "all-linear stands alone"),
    ("q_proj", "q_proj", DENSE_CONFIG, "--exclude-modules removes every layer"),
    ("all-linear", None, QWEN3_30B_A3B_CONFIG, "MoE model"),
    ("q_proj,down_proj", None, QWEN3_30B_A3B_CONFIG, "--target-modules q_proj,k_proj,v_proj,o_proj"),
])
def test_targets_that_cannot_be_adapted_are_refused(targets, exclude, config, message):
    with pytest.raises(ArgumentError, match=message):
        resolve_target_modules(targets, exclude, config)


def test_moe_attention_only_is_accepted():
    assert resolve_target_modules("all-linear", "gate_proj,up_proj,down_proj", QWEN3_30B_A3B_CONFIG) == [
        "k_proj", "o_proj", "q_proj", "v_proj"]


def test_defaults_are_mileses_and_rank_zero_is_off():
    args = make_args()
    assert (args.lora_rank, args.lora_alpha, args.lora_dropout, args.lora_target_modules) == (0, 16, 0.0, [])
    args = make_args("--lora-rank", "8", "--target-modules", "all-linear")
    assert args.lora_target_modules == ALL


@pytest.mark.parametrize("flags, message", [
    (("--lora-rank", "8"), "needs --target-modules"),
    (("--target-modules", "all-linear"), "--target-modules configures LoRA training: pass --lora-rank"),
    (("--lora-train-only",), "pass --lora-rank"),
    (("--lora-rank", "-1", "--target-modules", "q_proj"), "--lora-rank -1: must be >= 0"),
    (("--lora-rank", "8", "--target-modules", "q_proj", "--lora-dropout", "1.0"), "--lora-dropout 1.0: must be in \\[0, 1\\)"),
    (("--lora-rank", "8", "--target-modules", "q_proj", "--only-train-params-name-list", "q"), "drop the freezing"),
    (("--lora-rank", "8", "--target-modules", "q_proj", "--ref-update-interval", "2"), "--ref-update-interval"),
    (("--lora-rank", "8", "--target-modules", "q_proj", "--lora-train-only", "--check-lora-weight-equal"),
     "pass one of them"),
])
def test_lora_flag_mistakes_name_the_flag(flags, message):
    with pytest.raises(ArgumentError, match=message):
        make_args(*flags)


def test_kl_needs_no_ref_load_with_lora():
    args = make_args("--lora-rank", "4", "--target-modules", "all-linear", "--use-kl-loss", "--kl-loss-coef", "0.1")
    assert args.ref_load is None


def test_adapter_folder_must_match_rank_alpha_and_targets(tmp_path):
    folder = tmp_path / "adapter"
    with pytest.raises(ArgumentError, match="no adapter_config.json"):
        make_args("--lora-rank", "4", "--target-modules", "all-linear", "--lora-adapter-path", folder)
    folder.mkdir()
    (folder / "adapter_model.safetensors").write_bytes(b"")
    (folder / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16, "target_modules": ALL}))
    with pytest.raises(ArgumentError, match="pass --lora-rank 8 --lora-alpha 16"):
        make_args("--lora-rank", "4", "--target-modules", "all-linear", "--lora-adapter-path", folder)
    with pytest.raises(ArgumentError, match="pass --target-modules down_proj,gate_proj"):
        make_args("--lora-rank", "8", "--target-modules", "q_proj", "--lora-adapter-path", folder)
    args = make_args("--lora-rank", "8", "--target-modules", "all-linear", "--lora-adapter-path", folder)
    assert args.lora_adapter_path == str(folder)


@pytest.mark.parametrize("extra, message", [
    (["--target-modules", "q_proj,o_proj"], "fused linear_qkv as one layer .*got q_proj"),
    (["--target-modules", "gate_proj,down_proj"], "fused linear_fc1 as one layer .*got gate_proj"),
    (["--target-modules", "all-linear", "--sequence-parallel"], "drop --sequence-parallel"),
    (["--target-modules", "all-linear", "--lora-dropout", "0.1"], "--lora-dropout 0.1 with --tensor-model-parallel"),
])
def test_megatron_lora_layouts_it_cannot_run_are_refused(tmp_path, data, extra, message):
    from slime.config.arguments import parse_args

    with pytest.raises(ArgumentError, match=message):
        parse_args(base(tmp_path, data, "--train-backend", "megatron", "--actor-num-gpus-per-node", "2",
                        "--tensor-model-parallel-size", "2", "--lora-rank", "8", *extra))


def test_megatron_lora_with_whole_fused_layers_is_accepted(tmp_path, data):
    from slime.config.arguments import parse_args

    args = parse_args(base(tmp_path, data, "--train-backend", "megatron", "--actor-num-gpus-per-node", "2",
                           "--tensor-model-parallel-size", "2", "--lora-rank", "8", "--target-modules",
                           "linear_qkv,linear_fc2"))
    assert args.lora_target_modules == ["down_proj", "k_proj", "q_proj", "v_proj"]


MULTI = ("--lora-rank", "8", "--target-modules", "all-linear")


@pytest.mark.parametrize("flags, message", [
    (("--lora-adapter-key", "task"), "go together"),
    (("--lora-adapter-names", "a,b"), "go together"),
    (("--lora-adapter-key", "task", "--lora-adapter-names", "a,a"), "given twice"),
    (("--lora-adapter-key", "task", "--lora-adapter-names", "a@1,b"), "letters, digits"),
    (("--lora-adapter-key", "task", "--lora-adapter-names", "a,b,c", "--sglang-max-loras-per-batch", "4"),
     "3 adapters need 6 engine slots"),
    (("--lora-adapter-key", "task", "--lora-adapter-names", "a,b", "--save-hf", "/tmp/x"), "--save-hf writes one"),
])
def test_several_adapters_mistakes_name_the_flag(flags, message):
    with pytest.raises(ArgumentError, match=message):
        make_args(*MULTI, *flags)


def test_several_adapters_need_the_fsdp_backend_and_enough_engine_slots(tmp_path, data):
    from slime.config.arguments import parse_args
    from slime.config.flags_sglang import engine_config_from_sglang_flags

    with pytest.raises(ArgumentError, match="--lora-adapter-key .* pass --train-backend fsdp"):
        parse_args(base(tmp_path, data, "--train-backend", "megatron", *MULTI, "--lora-adapter-key", "task",
                        "--lora-adapter-names", "a,b"))
    args = make_args(*MULTI, "--lora-adapter-key", "task", "--lora-adapter-names", "a,b,c,d,e")
    assert args.lora_adapter_names == ["a", "b", "c", "d", "e"]
    assert engine_config_from_sglang_flags(args)[0]["max_loras_per_batch"] == 10  # each adapter's version and the previous


def test_a_row_names_its_adapter_and_a_group_never_mixes_adapters():
    from slime.ray.train_data import lora_adapter_indices
    from slime.rollout.dataset import PromptFormat, row_to_sample
    from slime.utils.types import Sample

    fmt = PromptFormat(input_key="q", lora_adapter_key="task", lora_adapter_names=("a", "b"))
    assert row_to_sample({"q": "1+1", "task": "b"}, "data.jsonl:1", fmt, None).metadata["lora_adapter"] == "b"
    with pytest.raises(ValueError, match=r"data.jsonl:2: .*'task' \(--lora-adapter-key\) is 'c'"):
        row_to_sample({"q": "1+1", "task": "c"}, "data.jsonl:2", fmt, None)
    args = make_args(*MULTI, "--lora-adapter-key", "task", "--lora-adapter-names", "a,b")
    samples = [Sample(index=i, group_index=i // 2, metadata={"lora_adapter": name})
               for i, name in enumerate(["b", "b", "a", "a"])]
    assert lora_adapter_indices(args, samples) == [1, 1, 0, 0]
    samples[3].metadata["lora_adapter"] = "b"
    with pytest.raises(ValueError, match="group 1 mixes LoRA adapters 'a' and 'b'"):
        lora_adapter_indices(args, samples)
