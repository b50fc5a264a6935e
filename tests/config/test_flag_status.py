"""slime's flags: every one of THUDM/slime's arguments.py is accepted with slime's default (or its status says
why not), the docs table lists them all, refused ones are errors, inert ones are reported, `--sglang-*` /
`--router-*` pass through with a closest-spelling error for typos."""

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from slime.config import flag_status
from slime.config.arguments import build_parser, parse_args
from slime.config.errors import ArgumentError
from slime.config.flags_sglang import sglang_server_flags

REPO = Path(__file__).resolve().parents[2]
SLIME_FLAGS = json.loads((REPO / "tests/slime_upstream/slime_flags.json").read_text())["flags"]
HF_CONFIG = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64,
             "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
             "vocab_size": 1000, "max_position_embeddings": 512}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("flags")
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text(json.dumps(HF_CONFIG))
    (root / "data.jsonl").write_text('{"input": "1+1", "label": "2"}\n')
    return ["--hf-checkpoint", str(root / "model"), "--prompt-data", str(root / "data.jsonl"),
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "1", "--rm-type", "math"]


def test_every_slime_flag_is_accepted_with_slime_default(base):
    actions = {option: action for action in build_parser()._actions for option in action.option_strings}
    args = parse_args(base)
    for row in SLIME_FLAGS:
        if row["dest"] in flag_status.DEFINED_ELSEWHERE and row["flag"] not in actions:
            continue  # registered by another part of the project (the table says which)
        action = actions.get(row["flag"])
        assert action is not None, f"slime flag {row['flag']} is not accepted"
        assert hasattr(args, row["dest"]), f"{row['flag']}: args has no {row['dest']} (slime's name for it)"
        if row["dest"] not in flag_status.DEFAULTS_CHANGED and not row["required"]:
            assert action.default == row["default"], f"{row['flag']}: default {action.default!r}, " \
                                                      f"slime's {row['default']!r}"


def test_statuses_name_real_flags_and_the_docs_table_is_current():
    dests = {row["dest"] for row in SLIME_FLAGS}
    for table in (flag_status.INERT, flag_status.REFUSED, flag_status.DEFINED_ELSEWHERE, flag_status.DEFAULTS_CHANGED):
        assert set(table) <= dests, set(table) - dests
    assert not set(flag_status.INERT) & set(flag_status.REFUSED)
    check = subprocess.run([sys.executable, "scripts/slime_flags_table.py", "--check"], cwd=REPO,
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    table = (REPO / "docs/reference/slime-flags.md").read_text()
    assert all(f"| `{row['flag']}` |" in table for row in SLIME_FLAGS)


@pytest.mark.parametrize("extra, message", [
    (["--rollout-data-transport", "nixl"], "--rollout-data-transport 'nixl': only the Ray object store"),
    (["--multimodal-keys", '{"video": "videos"}'], "--multimodal-keys: modality 'video' is not supported"),
    (["--multimodal-keys", '{"image": "images"}'], "--multimodal-keys needs --apply-chat-template"),
    (["--sglang-cuda-graf-max-bs", "8"], "did you mean --sglang-cuda-graph-max-bs"),
    (["--router-cache-treshold", "0.5"], "did you mean --router-cache-threshold"),
    (["--rollout-max-respose-len", "8"], "did you mean --rollout-max-response-len"),
    (["--opd-type", "sglang"], "--opd-type is only used with --use-opd"),
])
def test_refused_and_misspelt_flags_are_errors(base, extra, message):
    with pytest.raises(ArgumentError, match=message.replace("(", r"\(").replace("?", r"\?")):
        parse_args(base + extra)


def test_inert_and_unmapped_sglang_flags_are_reported_once(base, caplog):
    with caplog.at_level(logging.WARNING):
        args = parse_args(base + ["--ci-test", "--sglang-cuda-graph-max-bs", "8", "--sglang-mem-fraction-static",
                                  "0.5", "--sglang-enable-deterministic-inference"])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum("--ci-test" in w for w in warnings) == 1
    assert sum("--sglang-cuda-graph-max-bs" in w and "--sglang-enable-deterministic-inference" in w
               for w in warnings) == 1
    assert args.engine_config == {"gpu_memory_utilization": 0.5}  # the one with a meaning here
    assert args.sglang_cuda_graph_max_bs_decode == 8 and args.sglang_enable_deterministic_inference is True
    assert args.sglang_mem_fraction_static == 0.5  # typed as SGLang types it


def test_sglang_backend_gets_every_given_sglang_flag(base):
    args = parse_args(base + ["--sglang-cuda-graph-max-bs", "8", "--sglang-disable-radix-cache",
                              "--sglang-disable-overlap-schedule=false", "--sglang-mem-fraction-static", "0.7"])
    flags = sglang_server_flags(args)
    assert flags[flags.index("--cuda-graph-max-bs-decode") + 1] == "8"  # SGLang's own name for that alias
    assert flags[flags.index("--mem-fraction-static") + 1] == "0.7"
    assert "--disable-radix-cache" in flags and "--disable-overlap-schedule" not in flags  # given false
    assert args.engine_config == {"gpu_memory_utilization": 0.7, "overlap_schedule": True}


def test_switches_sharing_a_value_flags_destination_pass_as_themselves(base):
    """SGLang's --disable-piecewise-cuda-graph stores a constant into cuda_graph_backend_prefill, which
    --cuda-graph-backend-prefill sets to a value: each reaches SGLang as itself (not as the value flag with
    'True'), and the built-in engine maps the switch onto its prefill graphs."""
    args = parse_args(base + ["--sglang-disable-piecewise-cuda-graph"])
    flags = sglang_server_flags(args)
    assert "--disable-piecewise-cuda-graph" in flags and "--cuda-graph-backend-prefill" not in flags
    assert args.engine_config == {"prefill_cuda_graphs": False}
    args = parse_args(base + ["--sglang-cuda-graph-backend-prefill", "full"])
    flags = sglang_server_flags(args)
    assert flags[flags.index("--cuda-graph-backend-prefill") + 1] == "full"
    assert "--disable-piecewise-cuda-graph" not in flags
    assert args.engine_config == {}  # no meaning to the built-in engine (warned as unused)
    assert parse_args(base + ["--sglang-enforce-piecewise-cuda-graph"]).engine_config == {"prefill_cuda_graphs": True}


def test_router_flags_reach_a_real_router(base):
    from slime.ray.router import RouterProcess, list_workers

    args = parse_args(base + ["--router-cache-threshold", "0.5", "--router-max-tree-size", "1024",
                              "--router-dp-aware"])
    assert args.router_policy == "cache_aware" and args.router_log_level == "warn"
    assert args.router_flags == ["--cache-threshold", "0.5", "--balance-abs-threshold", "10",
                                 "--balance-rel-threshold", "1.2", "--max-tree-size", "1024", "--dp-aware"]
    router = RouterProcess(policy=args.router_policy, extra_flags=args.router_flags)
    try:
        assert list_workers(router.url) == []  # it started with those flags (a bad one exits at start-up)
    finally:
        router.shutdown()


def test_slime_defaults_and_rules(base, tmp_path):
    args = parse_args(base)
    assert args.rollout_max_response_len is None and args.apply_chat_template_kwargs == {}
    assert args.router_balance_abs_threshold == 10 and args.sglang_router_request_timeout_secs == 14400
    assert parse_args(base + ["--rollout-max-context-len", "100"]).eval_max_context_len == 100  # slime's default
    colocated = parse_args(base + ["--colocate", "--rollout-num-gpus", "1"])
    assert colocated.rollout_num_gpus == 1 and colocated.offload_train and colocated.offload_rollout
    config = tmp_path / "custom.yaml"
    config.write_text("mis_threshold: 0.5\nmy_plugin: {a: 1}\n")
    custom = parse_args(base + ["--custom-config-path", str(config),
                                "--apply-chat-template-kwargs", '{"enable_thinking": false}'])
    assert custom.mis_threshold == 0.5 and custom.my_plugin == {"a": 1}
    assert custom.apply_chat_template_kwargs == {"enable_thinking": False}
    assert parse_args(base + ["--use-opd", "--custom-generate-function-path",
                              "slime.rollout.sglang_rollout.generate"]).opd_type == "sglang"
    model = base[base.index("--hf-checkpoint") + 1]
    assert parse_args(base + ["--use-opd", "--opd-teacher-load", model]).opd_type == "megatron"
    with pytest.raises(ArgumentError, match="--opd-type sglang: teacher log-probs come from the rollout"):
        parse_args(base + ["--use-opd", "--opd-type", "sglang", "--opd-teacher-load", model])


def test_wandb_and_tensorboard_flags(base, tmp_path):
    from slime.utils.metrics import tensorboard_dir, wandb_init_kwargs

    args = parse_args(base + ["--use-wandb", "--wandb-team", "lab", "--wandb-group", "grpo", "--wandb-mode",
                              "offline", "--wandb-run-id", "abc", "--wandb-key", "secret", "--tb-project-name", "p",
                              "--tb-experiment-name", "e"])
    kwargs = wandb_init_kwargs(args, tmp_path)
    assert kwargs["entity"] == "lab" and kwargs["group"] == "grpo" and kwargs["mode"] == "offline"
    assert kwargs["id"] == "abc" and kwargs["resume"] == "allow" and kwargs["dir"] == str(tmp_path)
    assert kwargs["name"].startswith("grpo-") and len(kwargs["name"]) == len("grpo-") + 6
    assert kwargs["config"]["wandb_key"] == "<redacted>"
    plain = parse_args(base + ["--wandb-group", "grpo", "--disable-wandb-random-suffix"])
    assert wandb_init_kwargs(plain, tmp_path)["name"] == "grpo"
    assert tensorboard_dir(args, tmp_path) == tmp_path / "tensorboard" / "p" / "e"


def test_train_env_vars_reach_the_train_actors_runtime_env(base):
    from slime.ray.actor_group import train_actor_options
    from slime.ray.placement_group import DevicePlacement

    placement = DevicePlacement(pg=None, bundle_indices=[0], use_gpu=False)
    args = parse_args(base + ["--train-env-vars", '{"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "N": 2}'])
    assert train_actor_options(args, placement, 0)["runtime_env"] == {
        "env_vars": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "N": "2"}}
    assert "runtime_env" not in train_actor_options(parse_args(base), placement, 0)
    with pytest.raises(ArgumentError, match="--train-env-vars"):  # not a JSON object
        parse_args(base + ["--train-env-vars", "[1, 2]"])
