"""Megatron's flags: Megatron's names and defaults, the rules of their combinations, the model presets and recipes in
scripts/, and four stock slime recipes (tests/data/slime_recipes, verbatim) parsed unchanged.

A recipe's flags come out of bash itself: only its array definitions, the model preset it sources and its train.py
command line are evaluated (never the rest: slime's recipes kill processes and start Ray)."""

import json
import logging
import os
import re
import subprocess
from pathlib import Path

import pytest

from slime.backends.megatron_utils.arguments import INERT, MEGATRON_FLAGS
from slime.utils.arguments import build_parser, parse_args
from slime.utils.validate_args import ArgumentError
from slime.utils import validate_megatron_args
from slime.utils.validate_megatron_args import require_train_backend

REPO = Path(__file__).resolve().parents[1]
STOCK = REPO / "tests/data/slime_recipes"

_QWEN3 = {"model_type": "qwen3", "vocab_size": 151936, "rope_theta": 1000000, "rms_norm_eps": 1e-6,
          "head_dim": 128, "hidden_act": "silu", "attention_bias": False, "max_position_embeddings": 40960}
_QWEN2 = {"model_type": "qwen2", "vocab_size": 151936, "rope_theta": 1000000, "rms_norm_eps": 1e-6,
          "hidden_act": "silu", "max_position_embeddings": 32768}
_LLAMA3 = {"model_type": "llama", "vocab_size": 128256, "rope_theta": 500000, "rms_norm_eps": 1e-5,
           "head_dim": 128, "hidden_act": "silu", "attention_bias": False, "num_hidden_layers": 32, "hidden_size": 4096,
           "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
           "tie_word_embeddings": False}


def _shape(layers, hidden, ffn, heads, kv_heads, tied):
    return {"num_hidden_layers": layers, "hidden_size": hidden, "intermediate_size": ffn, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "tie_word_embeddings": tied}


# The published config.json of each model a preset describes (the facts the presets are checked against).
HF_CONFIGS = {
    "qwen3-0.6B": {**_QWEN3, **_shape(28, 1024, 3072, 16, 8, True)},
    "qwen3-1.7B": {**_QWEN3, **_shape(28, 2048, 6144, 16, 8, True)},
    "qwen3-4B": {**_QWEN3, **_shape(36, 2560, 9728, 32, 8, True)},
    "qwen3-8B": {**_QWEN3, **_shape(36, 4096, 12288, 32, 8, False)},
    "qwen3-30B-A3B": {**_QWEN3, **_shape(48, 2048, 6144, 32, 4, False), "model_type": "qwen3_moe",
                      "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                      "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True},
    "qwen1.5-MoE-A2.7B": {**_QWEN2, **_shape(24, 2048, 5632, 16, 16, False), "model_type": "qwen2_moe",
                          "max_position_embeddings": 8192, "num_experts": 60, "num_experts_per_tok": 4,
                          "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
                          "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": False},
    "qwen2.5-0.5B": {**_QWEN2, **_shape(24, 896, 4864, 14, 2, True)},
    "qwen2.5-1.5B": {**_QWEN2, **_shape(28, 1536, 8960, 12, 2, True), "rope_theta": 10000,  # Qwen2.5-Math-1.5B
                     "max_position_embeddings": 4096},
    "qwen2.5-3B": {**_QWEN2, **_shape(36, 2048, 11008, 16, 2, True)},
    "qwen2.5-7B": {**_QWEN2, **_shape(28, 3584, 18944, 28, 4, False), "vocab_size": 152064},
    "llama3-8B": {**_LLAMA3, "max_position_embeddings": 8192},
    "llama3.1-8B-Instruct": {**_LLAMA3, "max_position_embeddings": 131072,
                             "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    "glm4-9B": {"model_type": "glm4", **_shape(40, 4096, 13696, 32, 2, False), "vocab_size": 151552,
                "head_dim": 128, "rope_theta": 10000, "rms_norm_eps": 1e-5, "partial_rotary_factor": 0.5,
                "attention_bias": True, "hidden_act": "silu", "max_position_embeddings": 32768},
}
# Recipe checkpoint folder -> the model it is.
RECIPE_MODELS = {"Qwen3-4B": "qwen3-4B", "Qwen3-4B-Base": "qwen3-4B", "Qwen3-30B-A3B": "qwen3-30B-A3B",
                 "GLM-Z1-9B-0414": "glm4-9B"}
# Megatron's MoE flags are slime/utils/moe_arguments.py's (branch moe); a checkout without them parses the recipes
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


def recipe_flags(script: Path) -> list[str]:
    """The flags a slime-style run script passes to train.py / train_async.py, as bash expands them."""
    text = script.read_text()
    model = re.search(r'^source "\$\{SCRIPT_DIR\}/(models/[^"]+)"$', text, re.M).group(1)
    defaults = "\n".join(re.findall(r"^[A-Z_]+=\$\{[A-Z_]+:-[^}$]*\}$", text, re.M))  # MODEL_DIR=${MODEL_DIR:-/root}
    arrays = "\n".join(m.group(0) for m in re.finditer(r"^[A-Z_]+=\(\n.*?^\)$", text, re.M | re.S))
    command = re.search(r"python3 \S*train(?:_async)?\.py\"? \\\n((?:.*\\\n)*.*\n)", text).group(1)
    return _bash_words(f'NUM_GPUS=8\nSCRIPT_DIR="{script.parent}"\n{defaults}\nsource "$SCRIPT_DIR/{model}"\n{arrays}\n'
                       f'ARGV=({command.replace(chr(92) + chr(10), chr(10))})\nprintf "%s\\0" "${{ARGV[@]}}"')


def _without(flags: list[str], dropped) -> list[str]:
    kept, skipping = [], False
    for token in flags:
        if token.startswith("--"):
            skipping = token in dropped
        if not skipping:
            kept.append(token)
    return kept


def _write_model(folder: Path, name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(HF_CONFIGS[name]))
    return folder


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("megatron_args") / "data.jsonl"
    path.write_text('{"input": "1+1", "label": "2"}\n')
    return path


def base(folder: Path, data: Path, *extra, model="qwen3-0.6B") -> list[str]:
    return ["--hf-checkpoint", str(_write_model(folder / model, model)), "--prompt-data", str(data),
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--num-rollout", "2", "--rm-type", "math",
            *map(str, extra)]


# ---- names and defaults ---------------------------------------------------------------------------------------

# Where this project's default differs from megatron-core 0.16.1's on purpose (docs/megatron-flags.md says why).
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
    table = (REPO / "docs/megatron-flags.md").read_text()
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
        _write_model(folder, RECIPE_MODELS[Path(flags[flags.index("--hf-checkpoint") + 1]).name])
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
    # two devices per engine: SGLang rolls out (the built-in engine runs one); the same folder for --load and --save
    assert (qwen3_4b.rollout_backend, qwen3_4b.rollout_num_engines) == ("sglang", 4)
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
    changed = {"--train-backend", "--load", "--load-if-exists", "--rollout-num-gpus-per-engine", "--ref-load"}
    ours = recipe_flags(REPO / "scripts" / recipe)
    assert _without(ours, changed) == _without(recipe_flags(STOCK / recipe), changed)
    flags, args = _parse_recipe(tmp_path, REPO / "scripts" / recipe)
    assert (args.train_backend, args.tensor_model_parallel_size) == ("megatron", tp)
    assert args.expert_model_parallel_size == ep
    assert args.ref_load == flags[flags.index("--hf-checkpoint") + 1]


# ---- rules ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra, message", [
    (["--actor-num-gpus-per-node", "4", "--tensor-model-parallel-size", "3"], "not divisible by --tensor-model"),
    (["--actor-num-gpus-per-node", "4", "--tensor-model-parallel-size", "2", "--context-parallel-size", "4"],
     r"\(2 x 1 x 4\)"),
    (["--actor-num-gpus-per-node", "2", "--expert-model-parallel-size", "2"], "needs an MoE model"),
    (["--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2", "--train-backend", "fsdp"],
     "--tensor-model-parallel-size 2 needs --train-backend megatron"),
    (["--actor-num-gpus-per-node", "2", "--pipeline-model-parallel-size", "2", "--train-backend", "fsdp"],
     "--pipeline-model-parallel-size 2 needs --train-backend megatron"),
    (["--num-layers-per-virtual-pipeline-stage", "2", "--train-backend", "megatron"],
     "virtual pipeline stages.*--pipeline-model-parallel-size > 1"),
    (["--actor-num-gpus-per-node", "2", "--pipeline-model-parallel-size", "2",
      "--num-layers-per-virtual-pipeline-stage", "5"], "14 layers per pipeline stage are not divisible"),
    (["--actor-num-gpus-per-node", "3", "--pipeline-model-parallel-size", "3", "--global-batch-size", "16"],
     "28 layers are not divisible by --pipeline-model-parallel-size 3"),
    (["--actor-num-gpus-per-node", "3", "--tensor-model-parallel-size", "3", "--global-batch-size", "16"],
     "16 attention heads are not divisible"),
    (["--decoder-last-pipeline-num-layers", "4"], "need --pipeline-model-parallel-size > 1"),
    (["--actor-num-gpus-per-node", "2", "--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank",
      "2", "--micro-batch-size", "16"], r"--num-virtual-stages-per-pipeline-rank \(virtual pipeline stages\): "
     r"--global-batch-size 16 / \(--micro-batch-size 16 x 1 data-parallel ranks\) = 1 micro-batches per step, not a "
     "multiple of --pipeline-model-parallel-size 2"),
    (["--actor-num-gpus-per-node", "2", "--pipeline-model-parallel-size", "2",
      "--num-layers-per-virtual-pipeline-stage", "7", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "64", "--global-batch-size", "1"],
     "with --use-dynamic-batch-size: --global-batch-size 1 over 1 data-parallel ranks is 1 samples per rank and step, "
     "not a multiple of --pipeline-model-parallel-size 2"),
    (["--train-backend", "megatron", "--micro-batch-size", "3"], "Megatron's rule"),
    (["--recompute-granularity", "selective"], "FSDP trainer recomputes whole decoder layers"),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2"],
     "FSDP trainer recomputes whole decoder layers"),
    (["--recompute-method", "uniform"], "need --recompute-granularity full"),
    (["--train-backend", "megatron", "--recompute-granularity", "full"], "needs --recompute-method"),
    (["--train-backend", "megatron", "--recompute-granularity", "selective", "--recompute-method", "uniform"],
     "selective takes no --recompute-method"),
    (["--train-backend", "megatron", "--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "29"], "more than the 28 layers"),
    (["--train-backend", "megatron", "--recompute-activations", "--recompute-granularity", "full"], "contradicts"),
    (["--fp16"], "--fp16 is not supported"),
    (["--attention-dropout", "0.1"], "--attention-dropout 0.1"),
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "3"], "--lr-warmup-fraction and --lr-warmup-iters"),
    (["--lr-warmup-fraction", "1.5"], "--lr-warmup-fraction"),
    (["--norm-epsilon", "1e-5"], "--norm-epsilon 1e-05 does not match rms_norm_eps"),
    (["--rotary-percent", "0.5"], "partial_rotary_factor=1.0"),
    (["--normalization", "LayerNorm"], "RMSNorm"),
    (["--untie-embeddings-and-output-weights"], "tie_word_embeddings=True"),
    (["--use-rope-scaling", "--rotary-scaling-factor", "8"], "rope_scaling"),
    (["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size 0: must be >= 1"),
])
def test_bad_megatron_combinations_name_the_flag(tmp_path, data, extra, message):
    with pytest.raises(ArgumentError, match=message):
        parse_args(base(tmp_path, data, *extra))


def test_moe_expert_parallel_rules(tmp_path, data):
    moe = ["--actor-num-gpus-per-node", "8", "--global-batch-size", "16"]
    args = parse_args(base(tmp_path, data, *moe, "--expert-model-parallel-size", "8", model="qwen3-30B-A3B"))
    assert args.train_backend == "megatron" and args.data_parallel_size == 8 and args.expert_tensor_parallel_size == 1
    with pytest.raises(ArgumentError, match="128 experts are not divisible by --expert-model-parallel-size 3"):
        parse_args(base(tmp_path, data, "--actor-num-gpus-per-node", "3", "--global-batch-size", "16",
                        "--expert-model-parallel-size", "3", model="qwen3-30B-A3B"))
    with pytest.raises(ArgumentError, match=r"--pipeline-model-parallel-size \(2 x 8 x 1\)"):
        parse_args(base(tmp_path, data, *moe, "--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "8",
                        model="qwen3-30B-A3B"))
    with pytest.raises(ArgumentError, match="--tensor-model-parallel-size 2 on an MoE model needs --sequence-parallel"):
        parse_args(base(tmp_path, data, *moe, "--tensor-model-parallel-size", "2", model="qwen3-30B-A3B"))
    with pytest.raises(ArgumentError, match="seq_aux_loss with --sequence-parallel"):
        parse_args(base(tmp_path, data, *moe, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                        "--moe-aux-loss-coeff", "0.01", "--moe-router-load-balancing-type", "seq_aux_loss",
                        model="qwen3-30B-A3B"))


def test_derived_layout_and_backend_defaults(tmp_path, data):
    fsdp = parse_args(base(tmp_path, data, "--actor-num-gpus-per-node", "2"))
    assert (fsdp.train_backend, fsdp.data_parallel_size, fsdp.virtual_pipeline_model_parallel_size) == ("fsdp", 2, None)
    assert (fsdp.adam_beta2, fsdp.weight_decay, fsdp.lr_decay_style) == (0.98, 0.0, "constant")
    assert fsdp.untie_embeddings_and_output_weights is False and fsdp.attention_dropout == 0.0
    assert fsdp.bf16 == (fsdp.device == "cuda") and not fsdp.use_distributed_optimizer

    megatron = parse_args(base(tmp_path, data, "--actor-num-gpus-per-node", "8", "--global-batch-size", "8",
                               "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                               "--num-virtual-stages-per-pipeline-rank", "2", "--micro-batch-size", "2"))
    assert megatron.train_backend == "megatron" and megatron.data_parallel_size == 2
    assert megatron.virtual_pipeline_model_parallel_size == 2 and megatron.expert_tensor_parallel_size == 2
    assert (megatron.adam_beta2, megatron.weight_decay, megatron.lr_decay_style) == (0.999, 0.01, "linear")
    assert megatron.use_distributed_optimizer and megatron.global_batch_size % (2 * 2) == 0

    per_stage = parse_args(base(tmp_path, data, "--actor-num-gpus-per-node", "2", "--pipeline-model-parallel-size",
                                "2", "--num-layers-per-virtual-pipeline-stage", "7"))
    assert per_stage.virtual_pipeline_model_parallel_size == 2  # 28 layers / 2 stages / 7 per virtual stage

    selective = parse_args(base(tmp_path, data, "--train-backend", "megatron", "--recompute-activations"))
    assert selective.recompute_granularity == "selective"  # Megatron's meaning of --recompute-activations
    full = parse_args(base(tmp_path, data, "--recompute-granularity", "full", "--recompute-method", "uniform",
                           "--recompute-num-layers", "1"))
    assert full.train_backend == "fsdp" and full.recompute_activations  # FSDP: checkpoint every decoder layer

    warmup = parse_args(base(tmp_path, data, "--lr-warmup-fraction", "0.25", "--num-steps-per-rollout", "4"))
    assert warmup.lr_warmup_iters == 2  # 0.25 x 2 rollouts x 4 steps


def test_data_parallel_size_decides_the_global_batch_rule(tmp_path, data):
    # 2 processes at TP 2 are one data-parallel rank: any global batch divides over it
    args = parse_args(base(tmp_path, data, "--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2",
                           "--global-batch-size", "1"))
    assert args.data_parallel_size == 1 and args.num_steps_per_rollout == 16
    with pytest.raises(ArgumentError, match="over 2 data-parallel ranks"):
        parse_args(base(tmp_path, data, "--actor-num-gpus-per-node", "2", "--global-batch-size", "1"))


def test_inert_flags_are_reported_once(tmp_path, data, caplog):
    with caplog.at_level(logging.WARNING):
        parse_args(base(tmp_path, data, "--attention-backend", "flash", "--no-rope-fusion", "--optimizer-cpu-offload",
                        "--moe-token-drop-policy", "probs", "--accumulate-allreduce-grads-in-fp32", "--qk-layernorm"))
    notices = sorted(r.getMessage() for r in caplog.records if "no effect here" in r.getMessage())
    assert [n.split(": no effect here")[0] for n in notices] == [
        "--accumulate-allreduce-grads-in-fp32", "--attention-backend, --no-rope-fusion", "--optimizer-cpu-offload",
        "--qk-layernorm"]  # --moe-token-drop-policy probs is its default
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        parse_args(base(tmp_path, data))
    assert "no effect" not in caplog.text
    assert all(flag.inert_because for flag in INERT)


def test_megatron_backend_must_import_at_start(tmp_path, data, monkeypatch):
    args = parse_args(base(tmp_path, data, "--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2"))
    monkeypatch.setattr(validate_megatron_args, "MEGATRON_BACKEND_MODULE", "slime.backends.megatron_utils.no_such")
    with pytest.raises(ArgumentError, match="no Megatron training backend.*--train-backend fsdp without "
                                            "--tensor-model-parallel-size 2$"):
        require_train_backend(args)
    monkeypatch.setattr(validate_megatron_args, "MEGATRON_BACKEND_MODULE", "slime.backends.megatron_utils.arguments")
    require_train_backend(args)
    require_train_backend(parse_args(base(tmp_path, data)))  # fsdp: nothing to check
    require_train_backend(parse_args(base(tmp_path, data, "--device", "cpu", "--actor-num-gpus-per-node", "2",
                                          "--pipeline-model-parallel-size", "2",
                                          "--num-virtual-stages-per-pipeline-rank", "2")))  # virtual stages run


@pytest.mark.parametrize("extra, message", [
    (["--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
     "--sequence-parallel runs on GPUs only.*drop it for a CPU run"),
])
def test_what_the_megatron_backend_does_not_run_is_refused_at_start(tmp_path, data, extra, message):
    args = parse_args(base(tmp_path, data, "--device", "cpu", *extra))  # Megatron's rules: the flags parse
    with pytest.raises(ArgumentError, match=message):
        require_train_backend(args)
    args.device = "cuda"
    if "--sequence-parallel" in extra:
        require_train_backend(args)  # on GPUs sequence parallelism runs


def test_context_parallelism_runs_on_dense_models_without_routing_replay(tmp_path, data):
    cp2 = ["--device", "cpu", "--actor-num-gpus-per-node", "2", "--context-parallel-size", "2"]
    dense = parse_args(base(tmp_path, data, *cp2))
    assert dense.train_backend == "megatron" and dense.data_parallel_size == 1
    require_train_backend(dense)  # dense models run context parallel, on the CPU too
    moe = parse_args(base(tmp_path, data, *cp2, model="qwen3-30B-A3B"))  # slime's recipes parse
    with pytest.raises(ArgumentError, match="--context-parallel-size 2 on an MoE model.*--context-parallel-size 1"):
        require_train_backend(moe)
    for flag in ("--use-routing-replay", "--use-rollout-routing-replay"):
        with pytest.raises(ArgumentError, match=f"{flag} with --context-parallel-size 2.*--context-parallel-size 1"):
            parse_args(base(tmp_path, data, *cp2, flag, model="qwen3-30B-A3B"))
