"""Megatron's flags: Megatron's names and defaults, the model presets and recipes in scripts/, and four stock slime
recipes (tests/data/slime_recipes, verbatim) parsed unchanged. The rules of their combinations:
test_megatron_layout_rules.py.

A recipe's flags come out of bash itself: only its array definitions, the model preset it sources and its train.py
command line are evaluated (never the rest: slime's recipes kill processes and start Ray)."""

import json
import logging
import os
import re
import subprocess
from pathlib import Path

import pytest

from slime.config.arguments import build_parser, parse_args
from slime.config.errors import ArgumentError
from slime.config.flags_megatron import MEGATRON_FLAGS
from tests.helpers.megatron_arg_helpers import HF_CONFIGS, base, data, write_model  # noqa: F401 (data: a fixture)

REPO = Path(__file__).resolve().parents[2]
STOCK = REPO / "tests/data/slime_recipes"

# Recipe checkpoint folder -> the model it is.
RECIPE_MODELS = {"Qwen3-4B": "qwen3-4B", "Qwen3-4B-Base": "qwen3-4B", "Qwen3-30B-A3B": "qwen3-30B-A3B",
                 "GLM-Z1-9B-0414": "glm4-9B"}
# Megatron's MoE flags are slime/config/flags_moe.py's (branch moe); a checkout without them parses the recipes
# without these.
MOE_TRAINER_FLAGS = {"--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size",
                     "--moe-shared-expert-intermediate-size", "--moe-layer-freq", "--moe-router-score-function",
                     "--moe-aux-loss-coeff", "--moe-router-load-balancing-type", "--moe-router-dtype",
                     "--moe-grouped-gemm", "--moe-token-dispatcher-type", "--moe-permute-fusion"}


def _bash_words(script: str) -> list[str]:
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True,
                            env={"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp")})
    return result.stdout.split("\0")[:-1]


def preset_flags(preset: Path) -> list[str]:
    return _bash_words(f'source "{preset}"; printf "%s\\0" "${{MODEL_ARGS[@]}}"')


def recipe_flags(script: Path, prelude: str = "") -> list[str]:
    """The flags a slime-style run script passes to train.py / train_async.py, as bash expands them (`prelude`:
    bash run first, e.g. the environment a recipe expects)."""
    text = script.read_text()
    model = re.search(r'^source "\$\{SCRIPT_DIR\}/(?:\.\./scripts/)?(models/[^"]+)"$', text, re.M).group(1)
    defaults = "\n".join(re.findall(r"^[A-Z_]+=\$\{[A-Z_]+:-[^}$]*\}$", text, re.M))  # MODEL_DIR=${MODEL_DIR:-/root}
    arrays = "\n".join(m.group(0) for m in re.finditer(r"^[A-Z_]+=\(\n.*?^\)$", text, re.M | re.S))
    command = re.search(r"python3 \S*train(?:_async)?\.py\"? \\\n((?:.*\\\n)*.*\n)", text).group(1)
    return _bash_words(f'{prelude}\nNUM_GPUS=8\nSCRIPT_DIR="{script.parent}"\n{defaults}\nsource "$SCRIPT_DIR/{model}"\n{arrays}\n'
                       f'ARGV=({command.replace(chr(92) + chr(10), chr(10))})\nprintf "%s\\0" "${{ARGV[@]}}"')


def _without(flags: list[str], dropped) -> list[str]:
    kept, skipping = [], False
    for token in flags:
        if token.startswith("--"):
            skipping = token in dropped
        if not skipping:
            kept.append(token)
    return kept


# ---- names and defaults ---------------------------------------------------------------------------------------

# Where this project's default differs from megatron-core 0.16.1's on purpose (docs/guides/megatron-parallelism.md says why).
DEFAULT_DEVIATIONS = {"--num-query-groups", "--rotary-base", "--rotary-percent", "--norm-epsilon", "--normalization",
                      "--position-embedding-type", "--untie-embeddings-and-output-weights",
                      "--attention-dropout", "--hidden-dropout", "--lr", "--adam-beta2", "--weight-decay",
                      "--lr-decay-style", "--micro-batch-size", "--mtp-loss-scaling-factor"}  # the last: slime's


def test_flags_have_megatrons_names_and_defaults():
    reference = json.loads((REPO / "tests/data/megatron_core_0.16.1_flags.json").read_text())["flags"]
    actions = {option: action for action in build_parser()._actions for option in action.option_strings}
    assert set(reference) - set(actions) == set()
    wrong = []
    for option, megatron in reference.items():
        action, default = actions[option], megatron["default"]
        switch_off = action.nargs == 0 and not action.default and not default  # store_true: False and None alike
        if action.dest != megatron["dest"] or (option not in DEFAULT_DEVIATIONS and not switch_off
                                               and action.default not in (default, [default])):
            wrong.append((option, action.dest, action.default, megatron))
        if megatron["choices"] and option not in ("--optimizer", "--lr-decay-style"):
            assert list(action.choices) == megatron["choices"], option
    assert wrong == []
    # every deviation is a real one, so the list cannot hide a flag that matches
    assert [o for o in DEFAULT_DEVIATIONS if actions[o].default == reference[o]["default"]] == []


def _options() -> set[str]:
    return {option for action in build_parser()._actions for option in action.option_strings}


def _absent_moe_flags() -> set[str]:
    return MOE_TRAINER_FLAGS - _options()


def test_every_megatron_flag_of_slimes_recipes_is_accepted():
    listed = [line for line in (STOCK / "megatron_flags.txt").read_text().splitlines() if line.startswith("--")]
    assert len(listed) == 94
    assert sorted(set(listed) - _options() - _absent_moe_flags()) == []


def test_docs_table_lists_every_flag_with_its_status():
    table = (REPO / "docs/guides/megatron-parallelism.md").read_text()
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(--[a-z0-9-]+)`[^|]*\| ([a-z ]+) \|", table, re.M)}
    for flag in MEGATRON_FLAGS:
        assert flag.option in rows, flag.option
        assert (rows[flag.option] == "no effect") == (flag.inert_because is not None), flag.option


# ---- presets and recipes -------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", sorted(p.stem for p in (REPO / "scripts/models").glob("*.sh")))
def test_model_preset_parses_and_matches_its_model(tmp_path, data, preset):
    flags = _without(preset_flags(REPO / f"scripts/models/{preset}.sh"), _absent_moe_flags())
    args = parse_args(base(tmp_path, data, *flags, model=preset))
    config = HF_CONFIGS[preset]
    assert (args.num_layers, args.hidden_size) == (config["num_hidden_layers"], config["hidden_size"])
    assert args.untie_embeddings_and_output_weights == (not config["tie_word_embeddings"])
    other = "glm4-9B" if preset != "glm4-9B" else "qwen3-4B"
    with pytest.raises(ArgumentError, match="config.json|HF config|not a mixture-of-experts model"):
        parse_args(base(tmp_path, data, *flags, model=other))


def _parse_recipe(tmp_path, script: Path):
    flags = [token.replace("/root/", f"{tmp_path}/") for token in recipe_flags(script)]
    flags = _without(flags, _absent_moe_flags())
    for flag in ("--hf-checkpoint", "--ref-load"):
        folder = Path(flags[flags.index(flag) + 1])
        write_model(folder, RECIPE_MODELS[Path(flags[flags.index("--hf-checkpoint") + 1]).name])
    for token in flags:
        if token.endswith((".jsonl", ".parquet")):
            Path(token).parent.mkdir(parents=True, exist_ok=True)
            Path(token).write_text('{"prompt": "1+1", "label": "2"}\n')
    return flags, parse_args(flags)


def test_stock_slime_recipes_parse_unchanged(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        _, qwen3_4b = _parse_recipe(tmp_path / "a", STOCK / "run-qwen3-4B.sh")
    assert qwen3_4b.train_backend == "megatron" and qwen3_4b.tensor_model_parallel_size == 2
    assert qwen3_4b.data_parallel_size == 4 and qwen3_4b.sequence_parallel
    assert (qwen3_4b.recompute_granularity, qwen3_4b.recompute_method, qwen3_4b.recompute_num_layers) == (
        "full", "uniform", 1)
    assert (qwen3_4b.adam_beta2, qwen3_4b.weight_decay, qwen3_4b.lr_decay_style) == (0.98, 0.1, "constant")
    assert qwen3_4b.global_batch_size == 256 and qwen3_4b.num_steps_per_rollout == 1
    # two devices per engine: four built-in engines of two ranks each; the same folder for --load and --save
    assert (qwen3_4b.rollout_backend, qwen3_4b.rollout_num_engines) == ("slime", 4)
    assert qwen3_4b.load == qwen3_4b.save and not qwen3_4b.load_if_exists
    assert "--attention-backend: no effect here" in caplog.text

    _, moe = _parse_recipe(tmp_path / "b", STOCK / "run-qwen3-30B-A3B.sh")
    assert (moe.expert_model_parallel_size, moe.expert_tensor_parallel_size, moe.data_parallel_size) == (8, 1, 2)
    assert moe.untie_embeddings_and_output_weights

    _, glm = _parse_recipe(tmp_path / "c", STOCK / "run-glm4-9B.sh")
    assert (glm.world_size, glm.context_parallel_size, glm.data_parallel_size, glm.rollout_num_gpus) == (4, 2, 1, 4)
    assert glm.rotary_percent == 0.5 and glm.add_qkv_bias

    caplog.clear()
    with caplog.at_level(logging.WARNING):
        _, sft = _parse_recipe(tmp_path / "d", STOCK / "run-qwen3-4B-base-sft.sh")
    assert sft.train_backend == "fsdp" and not sft.sequence_parallel and sft.recompute_activations
    assert sft.loss_type == "sft_loss" and (sft.lr_decay_style, sft.adam_beta2) == ("cosine", 0.95)
    assert "--sequence-parallel has no effect" in caplog.text and "--lr-warmup-fraction has no effect" in caplog.text


@pytest.mark.parametrize("recipe, tp, ep", [("run-qwen3-4B.sh", 2, 1), ("run-qwen3-30B-A3B.sh", 4, 8)])
def test_project_recipes_are_slimes_and_parse(tmp_path, recipe, tp, ep):
    changed = {"--train-backend", "--load", "--load-if-exists", "--ref-load"}
    ours = recipe_flags(REPO / "scripts" / recipe)
    assert _without(ours, changed) == _without(recipe_flags(STOCK / recipe), changed)
    flags, args = _parse_recipe(tmp_path, REPO / "scripts" / recipe)
    assert (args.train_backend, args.tensor_model_parallel_size) == ("megatron", tp)
    assert args.expert_model_parallel_size == ep
    assert args.ref_load == flags[flags.index("--hf-checkpoint") + 1]


# ---- rules ---------------------------------------------------------------------------------------------------
