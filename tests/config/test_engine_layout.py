"""--rollout-num-gpus-per-engine with the built-in engine: the rules an engine's layout must meet, checked when the
flags are parsed (each error names the flags and how to fix them), and what reaches the engine's Config."""

import json
from pathlib import Path

import pytest

from slime.config.arguments import parse_args
from slime.config.errors import ArgumentError
from slime.ray.engine_actor import engine_env, engine_server_command


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("layout")
    model = root / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": 2}))
    data = root / "data.jsonl"
    data.write_text('{"input": "1+1", "label": "2"}\n')
    return model, data


def parse(setup, *extra):
    model, data = setup
    return parse_args(["--hf-checkpoint", str(model), "--prompt-data", str(data), "--rollout-batch-size", "4",
                       "--num-rollout", "1", "--rm-type", "math", *extra])


@pytest.mark.parametrize("flags, engines", [
    (["--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2"], 2),
    (["--rollout-num-gpus", "8", "--rollout-num-gpus-per-engine", "8"], 1),
    (["--actor-num-gpus-per-node", "4", "--colocate", "--rollout-num-gpus-per-engine", "2"], 2),
    (["--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "4", "--sglang-ep-size", "2"], 1),
])
def test_layouts_the_built_in_engine_runs(setup, flags, engines):
    args = parse(setup, *flags)
    assert (args.rollout_backend, args.rollout_num_engines) == ("slime", engines)


@pytest.mark.parametrize("flags, message", [
    (["--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "2"],
     "--rollout-num-gpus 3 is not a multiple of --rollout-num-gpus-per-engine 2"),
    (["--actor-num-gpus-per-node", "3", "--colocate", "--rollout-num-gpus-per-engine", "2"],
     "--rollout-num-gpus 3 is not a multiple of --rollout-num-gpus-per-engine 2"),
    (["--rollout-num-gpus", "16", "--rollout-num-gpus-per-engine", "16", "--rollout-backend", "slime"],
     "--rollout-num-gpus-per-engine 16 is larger than --num-gpus-per-node 8"),
    (["--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "4", "--num-gpus-per-node", "2",
      "--rollout-backend", "slime"],
     "--rollout-num-gpus-per-engine 4 is larger than --num-gpus-per-node 2"),
    (["--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2", "--sglang-ep-size", "4"],
     "--sglang-ep-size 4 must divide --rollout-num-gpus-per-engine 2"),
    (["--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "4", "--sglang-ep-size", "3"],
     "--sglang-ep-size 3 must divide --rollout-num-gpus-per-engine 4"),
    (["--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "4", "--sglang-pp-size", "2",
      "--rollout-backend", "slime"],
     "--sglang-pp-size"),
    (["--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "4", "--sglang-dp-size", "2",
      "--rollout-backend", "slime"],
     "--sglang-dp-size"),
])
def test_layouts_refused_at_parse_time(setup, flags, message):
    with pytest.raises(ArgumentError, match=message.replace("+", r"\+")):
        parse(setup, *flags)


@pytest.mark.parametrize("flags, reason", [
    (["--rollout-num-gpus", "16", "--rollout-num-gpus-per-engine", "16"], "spans nodes"),
    (["--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "4", "--sglang-dp-size", "2"], "--sglang-dp-size"),
])
def test_layouts_only_sglang_runs_default_to_sglang(setup, flags, reason, caplog):
    """slime's DeepSeek / Kimi recipes (engines across nodes, DP attention) parse unchanged and roll out with SGLang,
    as in slime; the log says why. The built-in engine is still the default for every layout it runs."""
    with caplog.at_level("INFO", logger="slime.config.validate"):
        args = parse(setup, *flags)
    assert args.rollout_backend == "sglang" and reason in caplog.text
    assert parse(setup, "--rollout-num-gpus", "8", "--rollout-num-gpus-per-engine", "8").rollout_backend == "slime"


def test_sglang_keeps_its_own_layout_flags(setup):
    """With --rollout-backend sglang the pipeline / data-parallel flags go to SGLang (it shards by them itself)."""
    args = parse(setup, "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "4", "--sglang-pp-size", "2",
                 "--rollout-backend", "sglang")
    assert args.rollout_backend == "sglang" and args.sglang_pp_size == 2


def test_engine_config_gets_the_layout(setup, tmp_path):
    """The engine's config file carries tp_size N, ep_size (--sglang-ep-size) and the collective timeout
    (--sglang-dist-timeout); on the CPU the N ranks share the cores."""
    args = parse(setup, "--rollout-num-gpus", "8", "--rollout-num-gpus-per-engine", "4", "--sglang-ep-size", "2",
                 "--sglang-dist-timeout", "90", "--device", "cpu", "--output-dir", str(tmp_path))
    config_path = tmp_path / "engine_0.json"
    command = engine_server_command(args, 12345, config_path)
    assert command[command.index("--config-file") + 1] == str(config_path)
    engine = json.loads(Path(config_path).read_text())["engine"]
    assert (engine["tp_size"], engine["ep_size"], engine["dist_timeout_s"]) == (4, 2, 90.0)
    env = engine_env(args, None)
    assert "CUDA_VISIBLE_DEVICES" not in env and int(env["OMP_NUM_THREADS"]) >= 1


def test_engine_env_names_the_engines_devices(setup):
    args = parse(setup, "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2", "--device", "cuda")
    assert engine_env(args, ["2", "3"]) == {"CUDA_VISIBLE_DEVICES": "2,3"}
