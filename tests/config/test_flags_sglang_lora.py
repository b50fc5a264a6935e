"""The engine's LoRA knobs from slime's flags: --sglang-enable-lora / --sglang-max-lora-rank /
--sglang-max-loras-per-batch map onto the engine Config, and a LoRA run (--lora-rank > 0) turns the engine's LoRA on
at that rank unless told otherwise (--lora-train-only keeps the engines on the base)."""

from argparse import Namespace

import pytest

from slime.config.arguments import parse_args
from slime.config.errors import ArgumentError
from slime.config.flags_sglang import engine_config_from_sglang_flags
from tests.config.test_arguments import base, setup  # noqa: F401 (the fixture)


def test_lora_flags_map_onto_engine_config(setup):
    args = parse_args(base(setup, "--sglang-enable-lora", "true", "--sglang-max-lora-rank", "32",
                           "--sglang-max-loras-per-batch", "4"))
    assert args.engine_config == {"enable_lora": True, "max_lora_rank": 32, "max_loras_per_batch": 4}
    with pytest.raises(ArgumentError, match="--sglang-enable-lora 'maybe': expected true or false"):
        parse_args(base(setup, "--sglang-enable-lora", "maybe"))


def run_flags(**flags) -> Namespace:
    return Namespace(rollout_backend="slime", **flags)


def test_a_lora_run_serves_its_adapter_at_its_rank():
    config, _ = engine_config_from_sglang_flags(run_flags(lora_rank=8, lora_train_only=False))
    assert config == {"enable_lora": True, "max_lora_rank": 8}
    config, _ = engine_config_from_sglang_flags(run_flags(lora_rank=8, lora_train_only=False, sglang_max_lora_rank="16",
                                                          sglang_max_loras_per_batch="2"))
    assert config == {"enable_lora": True, "max_lora_rank": 16, "max_loras_per_batch": 2}
    assert engine_config_from_sglang_flags(run_flags(lora_rank=8, lora_train_only=True))[0] == {}
    assert engine_config_from_sglang_flags(run_flags(lora_rank=0, lora_train_only=False))[0] == {}
