"""Mistakes that used to pass silently are errors naming the flag, file or line and how to fix it: `--load` of
anything but a complete checkpoint, a truncated checkpoint file, a data row without its label, a hook path that
does not import, a numeric flag out of range. CPU only, no Ray, no engines."""

import json

import pytest
import torch

from slime.backends.checkpoint_files import resolve_load_dir
from slime.backends.fsdp_utils.checkpoint import load_training_state, save_checkpoint
from slime.config.arguments import build_parser, parse_args
from slime.config.flag_ranges import ANY, FLAG_RANGES
from slime.config.validate import HOOK_FLAGS, ArgumentError
from slime.rollout.dataset import PromptFormat, load_prompt_samples
from slime.utils.checkpoint_state import CheckpointError, load_run_state
from tests.helpers import args_helpers


def reward_without_label(args, sample):
    return float(len(sample.response))


reward_without_label.uses_label = False


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("loud")
    model = root / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3", "hidden_size": 8}))
    data = root / "data.jsonl"
    data.write_text('{"input": "1+1", "label": "2"}\n')
    return model, data


def argv(setup, *extra):
    model, data = setup
    return ["--hf-checkpoint", str(model), "--prompt-data", str(data), "--rollout-batch-size", "2",
            "--num-rollout", "2", "--rm-type", "math", *map(str, extra)]


def write_checkpoint(model_dir, save_root, rollout_id, run_state=True):
    """A checkpoint written by the trainer's own save_checkpoint (a one-layer model, one rank)."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return save_checkpoint(str(save_root), rollout_id, model, optimizer, scheduler, hf_checkpoint=str(model_dir),
                           tie_word_embeddings=False, rank=0,
                           run_state={"data_source": {"epoch_id": rollout_id}} if run_state else None)


@pytest.fixture
def two_checkpoints(setup, tmp_path):
    """`{save}/rollout_0` and `{save}/rollout_1`, `latest` naming rollout_1."""
    save = tmp_path / "save"
    write_checkpoint(setup[0], save, 0)
    write_checkpoint(setup[0], save, 1)
    return save


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


# ---------------------------------------------------------------------------------------------- 1. --load


def test_complete_checkpoint_resumes_with_its_run_state(setup, two_checkpoints):
    args = parse_args(argv(setup, "--load", two_checkpoints))
    assert load_run_state(args) == {"data_source": {"epoch_id": 1}}
    assert resolve_load_dir(str(two_checkpoints)) == two_checkpoints / "rollout_1"
    assert resolve_load_dir(str(two_checkpoints / "rollout_0")) == two_checkpoints / "rollout_0"


@pytest.mark.parametrize("make_folder, state", [(False, "does not exist"), (True, "is empty")])
def test_load_of_absent_or_empty_folder_needs_load_if_exists(setup, tmp_path, make_folder, state):
    folder = tmp_path / "ckpt"
    if make_folder:
        folder.mkdir()
        (folder / "rollout_0.tmp").mkdir()  # an unfinished first save does not count as a checkpoint
    with pytest.raises(ArgumentError, match=f"--load {folder}: the folder {state}.*--load-if-exists"):
        parse_args(argv(setup, "--load", folder))
    args = parse_args(argv(setup, "--load", folder, "--load-if-exists"))
    assert load_run_state(args) is None and resolve_load_dir(args.load) is None


def test_load_and_save_of_one_folder_start_fresh_while_it_holds_no_checkpoint(setup, tmp_path):
    """slime's recipes pass `--load X --save X`: resume when X holds a checkpoint, start from the HF weights before."""
    folder = tmp_path / "ckpt"
    args = parse_args(argv(setup, "--load", folder, "--save", f"{folder}/"))
    assert load_run_state(args) is None
    with pytest.raises(ArgumentError, match="the folder does not exist"):  # a different --save: most likely a typo
        parse_args(argv(setup, "--load", folder, "--save", tmp_path / "other"))


def test_load_if_exists_needs_load(setup):
    with pytest.raises(ArgumentError, match="--load-if-exists needs --load"):
        parse_args(argv(setup, "--load-if-exists"))


def test_latest_naming_a_missing_folder_names_it_and_the_previous_checkpoint(setup, two_checkpoints):
    (two_checkpoints / "latest").write_text("rollout_7")
    with pytest.raises(ArgumentError, match=r"latest names rollout_7, which does not exist.*"
                                            rf"--load {two_checkpoints / 'rollout_1'}"):
        parse_args(argv(setup, "--load", two_checkpoints))


@pytest.mark.parametrize("name", ["meta.json", "optimizer.pt", "rng/rank_0.pt", "run_state.json",
                                  "model.safetensors"])
def test_checkpoint_without_its_run_state_files_is_an_error(setup, two_checkpoints, name):
    (two_checkpoints / "rollout_1" / name).unlink()
    expected = rf"{two_checkpoints / 'rollout_1' / name} is missing.*--load {two_checkpoints / 'rollout_0'}"
    for extra in ((), ("--load-if-exists",)):  # an existing but incomplete checkpoint is an error either way
        with pytest.raises(ArgumentError, match=expected):
            parse_args(argv(setup, "--load", two_checkpoints, *extra))


def test_only_checkpoint_incomplete_says_there_is_no_earlier_one(setup, tmp_path):
    folder = write_checkpoint(setup[0], tmp_path / "save", 0, run_state=False)
    with pytest.raises(ArgumentError, match=f"{folder / 'run_state.json'} is missing.*no earlier complete checkpoint"):
        parse_args(argv(setup, "--load", tmp_path / "save"))


def test_load_of_model_weights_says_to_use_hf_checkpoint(setup, tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x")
    with pytest.raises(ArgumentError, match="not a checkpoint.*pass the folder as --hf-checkpoint"):
        parse_args(argv(setup, "--load", tmp_path))


def test_ppo_resume_needs_the_critic_checkpoint(setup, two_checkpoints):
    with pytest.raises(ArgumentError, match=f"needs the critic checkpoint {two_checkpoints / 'critic' / 'rollout_1'}"):
        parse_args(argv(setup, "--load", two_checkpoints, "--advantage-estimator", "ppo"))


# ------------------------------------------------------------------------------- 5. truncated checkpoint files


@pytest.mark.parametrize("name", ["optimizer.pt", "model.safetensors", "rng/rank_0.pt"])
def test_truncated_file_is_named_before_anything_starts(setup, two_checkpoints, name):
    truncate(two_checkpoints / "rollout_1" / name)
    expected = rf"{two_checkpoints / 'rollout_1' / name} is truncated.*--load {two_checkpoints / 'rollout_0'}"
    with pytest.raises(ArgumentError, match=expected):
        parse_args(argv(setup, "--load", two_checkpoints))
    with pytest.raises(CheckpointError, match=expected):  # the trainer checks the folder it loads the same way
        resolve_load_dir(str(two_checkpoints))


def test_optimizer_that_fails_to_load_is_named_with_the_previous_checkpoint(two_checkpoints):
    folder = two_checkpoints / "rollout_1"
    truncate(folder / "optimizer.pt")  # load_training_state itself, without the driver's check before it
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    with pytest.raises(CheckpointError, match=rf"{folder / 'optimizer.pt'} is truncated or corrupt.*"
                                              rf"--load {two_checkpoints / 'rollout_0'}"):
        load_training_state(folder, model, optimizer, scheduler, rank=0)
    assert load_training_state(two_checkpoints / "rollout_0", model, optimizer, scheduler, rank=0) == 0


# ------------------------------------------------------------------------------------------ 2. missing labels


def load(tmp_path, rows, **args):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    fmt = PromptFormat.from_args(args_helpers.make_args(label_key="label", **args))
    samples, _ = load_prompt_samples(str(path), fmt)
    return path, samples


def test_row_without_label_is_an_error_naming_file_and_line(tmp_path):
    rows = [{"input": "a", "label": "1"}, {"input": "b"}]
    with pytest.raises(ValueError, match=r"prompts.jsonl:2: label key 'label' .*--allow-missing-labels"):
        load(tmp_path, rows)


@pytest.mark.parametrize("args", [
    {"allow_missing_labels": True},
    {"rm_type": "random"},
    {"rm_type": "boxed_random"},
    {"custom_rm_path": f"{__name__}.reward_without_label"},
])
def test_missing_labels_allowed_when_the_reward_reads_none(tmp_path, args):
    _, samples = load(tmp_path, [{"input": "a", "label": "1"}, {"input": "b"}], **args)
    assert [s.label for s in samples] == ["1", None]


# --------------------------------------------------------------------------------------------------- 3. hooks


@pytest.mark.parametrize("dest", HOOK_FLAGS)
def test_hook_that_does_not_import_is_named_at_parse_time(setup, dest):
    flag = "--" + dest.replace("_", "-")
    with pytest.raises(ArgumentError, match=f"{flag}: cannot import module 'no_such_module'"):
        parse_args(argv(setup, flag, "no_such_module.fn"))


def test_hook_attribute_must_exist_and_be_callable(setup):
    with pytest.raises(ArgumentError, match="--custom-rm-path: module 'slime.rollout.rm_hub' has no attribute 'nope'"):
        parse_args(argv(setup, "--custom-rm-path", "slime.rollout.rm_hub.nope"))
    with pytest.raises(ArgumentError, match="--custom-rm-path: 'slime.rollout.rm_hub.RM_TYPES' is a tuple, not a"):
        parse_args(argv(setup, "--custom-rm-path", "slime.rollout.rm_hub.RM_TYPES"))
    assert parse_args(argv(setup, "--custom-rm-path", f"{__name__}.reward_without_label")).custom_rm_path


# ------------------------------------------------------------------------------------------- 4. numeric ranges


@pytest.mark.parametrize("flag, value, allowed", [
    ("--rollout-max-response-len", "0", ">= 1"),
    ("--rollout-batch-size", "0", ">= 1"),
    ("--lr", "-0.001", ">= 0"),
    ("--rollout-temperature", "0.0", "> 0 \\(log-probs are taken at this temperature\\)"),
    ("--eval-temperature", "-0.5", ">= 0"),
    ("--rollout-top-p", "0.0", r"in \(0, 1\]"),
    ("--rollout-top-p", "1.5", r"in \(0, 1\]"),
    ("--rollout-top-k", "0", ">= 1 or -1"),
    ("--gamma", "1.01", r"in \[0, 1\]"),
    ("--kl-loss-coef", "-0.1", ">= 0"),
    ("--adam-beta2", "1.0", r"in \[0, 1\)"),
    ("--sglang-router-port", "70000", r"in \[1, 65535\]"),
    ("--seed", "-1", r"in \[0, 4294967295\]"),
])
def test_out_of_range_flag_names_flag_value_and_range(setup, flag, value, allowed):
    with pytest.raises(ArgumentError, match=rf"^{flag} {value}: must be {allowed}"):
        parse_args(argv(setup, flag, value))


def test_list_flag_checks_every_value(setup):
    with pytest.raises(ArgumentError, match="--rollout-stop-token-ids -1: must be >= 0"):
        parse_args(argv(setup, "--rollout-stop-token-ids", "5", "-1"))


def test_range_boundaries_and_sentinels_pass(setup):
    args = parse_args(argv(setup, "--rollout-top-p", "1", "--rollout-top-k", "-1", "--eval-temperature", "0",
                           "--lr", "0", "--gamma", "0", "--num-rollout", "0", "--sglang-router-port", "65535",
                           "--sglang-router-ip", "127.0.0.1"))
    assert args.rollout_top_p == 1.0 and args.rollout_top_k == -1 and args.eval_temperature == 0.0


def test_every_numeric_flag_has_a_range():
    numeric = {a.dest for a in build_parser()._actions if a.type in (int, float)}
    assert numeric == set(FLAG_RANGES), "give each numeric flag a rule in FLAG_RANGES (ANY if none applies)"
    assert sum(rule is ANY for rule in FLAG_RANGES.values()) <= 4  # seeds and sentinel-only values
