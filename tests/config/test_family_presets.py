"""slime's presets and recipes of the GLM-4.5 and DeepSeek-V3 families: each preset (scripts/models/, slime's flags
verbatim) states the published config.json's values (tests/helpers/megatron_arg_helpers.py's HF_CONFIGS, with
their source) and a config that differs in one of them is refused naming the flag; slime's run scripts for these
families (tests/data/slime_recipes, verbatim; also under scripts/) parse unchanged, --ref-load naming a Megatron
checkpoint without config.json, as slime's converter writes it."""

from __future__ import annotations

from pathlib import Path

import pytest

from slime.config.arguments import parse_args
from slime.config.errors import ArgumentError
from slime.config.validate_megatron import require_train_backend
from tests.config.test_flags_megatron import _without, preset_flags, recipe_flags
from tests.helpers.megatron_arg_helpers import HF_CONFIGS, base, data  # noqa: F401 (data: a fixture)

REPO = Path(__file__).resolve().parents[2]
STOCK = REPO / "tests/data/slime_recipes"
FAMILY_PRESETS = ("glm4.5-355B-A32B", "glm4.5-106B-A12B", "glm4.7-30B-A3B", "deepseek-v3", "kimi-k2", "moonlight")
# Preset flag -> what it must equal in the published config.json.
PUBLISHED = {
    "num_layers": lambda c: c["num_hidden_layers"], "hidden_size": lambda c: c["hidden_size"],
    "ffn_hidden_size": lambda c: c["intermediate_size"], "num_attention_heads": lambda c: c["num_attention_heads"],
    "vocab_size": lambda c: c["vocab_size"], "rotary_base": lambda c: c["rope_theta"],
    "num_experts": lambda c: c["n_routed_experts"], "moe_router_topk": lambda c: c["num_experts_per_tok"],
    "moe_ffn_hidden_size": lambda c: c["moe_intermediate_size"],
    "moe_shared_expert_intermediate_size": lambda c: c["moe_intermediate_size"] * c["n_shared_experts"],
    "moe_router_topk_scaling_factor": lambda c: c["routed_scaling_factor"],
    "moe_router_num_groups": lambda c: c["n_group"], "moe_router_group_topk": lambda c: c["topk_group"],
    "q_lora_rank": lambda c: c.get("q_lora_rank"), "kv_lora_rank": lambda c: c["kv_lora_rank"],
    "qk_head_dim": lambda c: c["qk_nope_head_dim"], "qk_pos_emb_head_dim": lambda c: c["qk_rope_head_dim"],
    "v_head_dim": lambda c: c["v_head_dim"],
}
# The flag a one-field change of config.json must be refused for.
MUTATIONS = {
    "glm4.5-355B-A32B": [("n_routed_experts", 128, "--num-experts"), ("first_k_dense_replace", 1, "--moe-layer-freq"),
                         ("partial_rotary_factor", 1.0, "--rotary-percent"),
                         ("routed_scaling_factor", 1.0, "--moe-router-topk-scaling-factor")],
    "glm4.5-106B-A12B": [("n_shared_experts", 2, "--moe-shared-expert-intermediate-size")],
    "glm4.7-30B-A3B": [("qk_nope_head_dim", 128, "--qk-head-dim"), ("v_head_dim", 128, "--v-head-dim")],
    "deepseek-v3": [("n_group", 1, "--moe-router-num-groups"), ("topk_group", 2, "--moe-router-group-topk"),
                    ("rope_scaling", None, "--rotary-scaling-factor"), ("q_lora_rank", None, "--q-lora-rank")],
    "kimi-k2": [("kv_lora_rank", 256, "--kv-lora-rank"), ("routed_scaling_factor", 2.5,
                                                            "--moe-router-topk-scaling-factor")],
    "moonlight": [("qk_rope_head_dim", 32, "--qk-pos-emb-head-dim"), ("moe_intermediate_size", 1024,
                                                                       "--moe-ffn-hidden-size")],
}


def _flags(preset: str) -> list[str]:
    return preset_flags(REPO / f"scripts/models/{preset}.sh")


@pytest.mark.parametrize("preset", FAMILY_PRESETS)
def test_preset_is_slimes_and_states_the_published_config(tmp_path, data, preset):
    assert _flags(preset) == preset_flags(STOCK / f"models/{preset}.sh")  # slime's flags, verbatim
    args = parse_args(base(tmp_path, data, *_flags(preset), model=preset))
    config, given = HF_CONFIGS[preset], set(_flags(preset))
    checked = 0
    for dest, published in PUBLISHED.items():
        if f"--{dest.replace('_', '-')}" in given:
            assert getattr(args, dest) == pytest.approx(published(config)), dest
            checked += 1
    assert checked >= (14 if args.multi_latent_attention else 9)
    layers = [int(i >= config["first_k_dense_replace"]) for i in range(config["num_hidden_layers"])]
    assert _moe_layers(args.moe_layer_freq, config["num_hidden_layers"]) == layers
    assert args.moe_router_score_function == "sigmoid" and args.untie_embeddings_and_output_weights


def _moe_layers(value: str, num_layers: int) -> list[int]:
    from slime.config.flags_moe import _layer_pattern

    return _layer_pattern(value, num_layers)


@pytest.mark.parametrize("preset, field, value, flag", [(p, f, v, flag) for p, cases in MUTATIONS.items()
                                                         for f, v, flag in cases])
def test_a_config_that_differs_is_refused_naming_the_flag(tmp_path, data, preset, field, value, flag):
    HF_CONFIGS["mutated"] = {**HF_CONFIGS[preset], field: value}
    try:
        with pytest.raises(ArgumentError, match=flag):
            parse_args(base(tmp_path, data, *_flags(preset), model="mutated"))
    finally:
        del HF_CONFIGS["mutated"]


def _slime_torch_dist(folder: Path) -> None:
    """A folder as slime's tools/convert_hf_to_torch_dist.py leaves it (the layout only: parsing reads no tensor)."""
    (folder / "release").mkdir(parents=True)
    (folder / "latest_checkpointed_iteration.txt").write_text("release")
    (folder / "release" / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')


def _parse_with_files(flags: list[str], preset: str, tmp_path: Path):
    from tests.helpers.megatron_arg_helpers import write_model

    write_model(Path(flags[flags.index("--hf-checkpoint") + 1]), preset)
    ref_load = Path(flags[flags.index("--ref-load") + 1])
    if not ref_load.exists():
        _slime_torch_dist(ref_load)
    for token in flags:
        if token.endswith((".jsonl", ".parquet")):
            Path(token).parent.mkdir(parents=True, exist_ok=True)
            Path(token).write_text('{"prompt": "1+1", "label": "2"}\n')
    return parse_args(flags)


RECIPES = {"run-glm4.7-355B-A32B.sh": ("glm4.5-355B-A32B", 8, 16), "run-glm4.7-30B-A3B.sh": ("glm4.7-30B-A3B", 2, 8),
           "run-deepseek-r1.sh": ("deepseek-v3", 8, 32), "run-kimi-k2-Instruct.sh": ("kimi-k2", 8, 32),
           "run-moonlight-16B-A3B.sh": ("moonlight", 4, 8)}


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_slimes_family_recipes_parse_unchanged(tmp_path, recipe):
    ours, stock = (REPO / "scripts" / recipe).read_text(), (STOCK / recipe).read_text()
    # slime's Kimi recipe lacks a line continuation after --update-weight-buffer-size (bash then runs train.py
    # without the flags below it); scripts/ has the one-character fix
    assert ours == (stock.replace("1024))\n", "1024)) \\\n") if "kimi" in recipe else stock)
    preset, tp, ep = RECIPES[recipe]
    flags = [token.replace("/root/", f"{tmp_path}/") for token in recipe_flags(REPO / "scripts" / recipe,
                                                                                f'BASE_DIR="{tmp_path}"')]
    if "--enable-mtp-training" in flags:  # GLM-4.7-Flash's MTP layers: built by neither backend, refused by name
        with pytest.raises(ArgumentError, match="--enable-mtp-training True: .*multi-token-prediction"):
            _parse_with_files(flags, preset, tmp_path)
        flags = _without(flags, {"--mtp-num-layers", "--enable-mtp-training", "--mtp-loss-scaling-factor"})
    if "glm4.7-30B" in recipe:  # slime's own recipe: EP 8 x PP 2 on its 8 GPUs, which megatron-core refuses too
        with pytest.raises(ArgumentError, match="8 trainer processes are not divisible by --expert-tensor-parallel-"
                                                r"size x --expert-model-parallel-size x .*\(1 x 8 x 2\)"):
            _parse_with_files(flags, preset, tmp_path)
        flags[flags.index("--actor-num-nodes") + 1] = "2"
    args = _parse_with_files(flags, preset, tmp_path)
    ref_load = Path(flags[flags.index("--ref-load") + 1])
    assert args.train_backend == "megatron" and args.multi_latent_attention == (preset not in ("glm4.5-355B-A32B",))
    assert (args.tensor_model_parallel_size, args.expert_model_parallel_size) == (tp, ep)
    assert not (ref_load / "config.json").exists() and Path(args.ref_load) == ref_load
    # the large-MoE recipes' DeepEP dispatcher is refused when the run starts, not when it parses
    with pytest.raises(ArgumentError, match="--moe-token-dispatcher-type flex"):
        require_train_backend(args)


@pytest.mark.parametrize("family", ["glm4.5", "glm4.7-flash", "deepseek-v3", "kimi-k2", "moonlight"])
def test_scaled_preset_flags_describe_the_tiny_family_checkpoints(tmp_path, data, family):
    """The tiny recipes' model flags (tests/e2e/test_family_recipes.py) against the config.json transformers writes."""
    from slime.utils.tiny_model import build_tiny_model
    from tests.helpers.family_checkpoints import build_family_checkpoint, scaled_preset_flags

    tokenizer = build_tiny_model(tmp_path / "tokenizer", vocab_size=300)
    hf = build_family_checkpoint(tmp_path / family, family, tokenizer)
    flags = scaled_preset_flags(family)
    args = parse_args(["--hf-checkpoint", str(hf), "--prompt-data", str(data), "--rm-type", "math",
                       "--rollout-batch-size", "2", "--num-rollout", "1", "--train-backend", "megatron", *flags])
    assert args.num_experts == 8 and args.moe_router_score_function == "sigmoid"
    wrong = [f if f != flags[flags.index("--moe-router-topk-scaling-factor") + 1] else "1.0" for f in flags]
    with pytest.raises(ArgumentError, match="--moe-router-topk-scaling-factor 1.0 does not match routed_scaling"):
        parse_args(["--hf-checkpoint", str(hf), "--prompt-data", str(data), "--rm-type", "math",
                    "--rollout-batch-size", "2", "--num-rollout", "1", "--train-backend", "megatron", *wrong])
