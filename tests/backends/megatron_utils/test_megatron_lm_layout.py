"""Megatron checkpoints in Megatron-LM's folder layout, as slime's converter writes them and slime's Megatron saves
them: HF -> torch_dist (a `release` folder, Transformer Engine's parameter names, no config.json) -> HF is bit-exact
for a dense and an MoE model; such a checkpoint and an `iter_%07d` one are read by --ref-load and --load without a
config.json beside them; --ckpt-step / --ref-ckpt-step pick an iteration; a tracker file naming a missing iteration
is an error naming the file and the iteration."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slime.config.arguments import parse_args
from slime.config.errors import ArgumentError
from tests.helpers.fsdp_helpers import make_train_data, make_trainer, run_distributed
from tests.helpers.megatron_helpers import make_megatron_args

pytest.importorskip("megatron.core")
REPO = Path(__file__).resolve().parents[3]
HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "chat_template.jinja")


def _run(*command):
    result = subprocess.run([sys.executable, *map(str, command)], cwd=REPO, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-6000:]


def _slime_converted(hf: Path, root: Path) -> Path:
    """slime's tools/convert_hf_to_torch_dist.py output: the torch_dist files only, no HF files beside them."""
    _run("tools/convert_hf_to_torch_dist.py", "--hf-checkpoint", hf, "--save", root)
    for name in HF_FILES:
        (root / "release" / name).unlink(missing_ok=True)
    return root


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from slime.utils.tiny_model import build_tiny_model

    folder = tmp_path_factory.mktemp("megatron_lm_layout")
    dense = build_tiny_model(folder / "dense", arch="qwen3", seed=3, vocab_size=300)
    moe = build_tiny_model(folder / "moe", arch="qwen3_moe", seed=4, vocab_size=300, tie_word_embeddings=False)
    return {"dense": dense, "moe": moe, "dense_slime": _slime_converted(dense, folder / "dense_torch_dist")}


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_hf_to_megatron_lm_release_and_back_is_bit_exact_with_te_names(models, tmp_path, model):
    from megatron.core.dist_checkpointing import load_common_state_dict, load_tensors_metadata
    from safetensors.torch import load_file

    hf, root = models[model], _slime_converted(models[model], tmp_path / "torch_dist")
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert sorted(p.name for p in root.iterdir()) == ["latest_checkpointed_iteration.txt", "release"]
    common = load_common_state_dict(str(root / "release"))
    assert common["args"].num_layers == 2 and common["args"].tensor_model_parallel_size == 1
    assert common["checkpoint_version"] == 3.0 and common["iteration"] == 0
    keys = set(load_tensors_metadata(str(root / "release")))
    # Transformer Engine's spec names: norms fused into the next linear, except an MoE layer's pre-MLP norm
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in keys
    assert "decoder.layers.input_layernorm.weight" not in keys
    moe_norm, fused_norm = "decoder.layers.pre_mlp_layernorm.weight", "decoder.layers.mlp.linear_fc1.layer_norm_weight"
    assert (moe_norm in keys, fused_norm in keys) == ((True, False) if model == "moe" else (False, True))
    if model == "moe":
        assert "decoder.layers.mlp.experts.experts.linear_fc1.weight" in keys
    _run("tools/convert_torch_dist_to_hf.py", "--input-dir", root, "--output-dir", tmp_path / "back",
         "--origin-hf-dir", hf)
    original, converted = load_file(str(hf / "model.safetensors")), load_file(str(tmp_path / "back" /
                                                                                   "model.safetensors"))
    assert set(converted) == set(original)
    for name, tensor in original.items():
        assert torch.equal(converted[name], tensor), name


def test_converting_back_without_an_architecture_names_origin_hf_dir(models, tmp_path):
    result = subprocess.run([sys.executable, "tools/convert_torch_dist_to_hf.py", "--input-dir",
                             str(models["dense_slime"]), "--output-dir", str(tmp_path / "out")], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "pass --origin-hf-dir" in result.stderr


def _reads_megatron_lm_checkpoints(rank, world_size, port, hf, release_root, save):
    """--ref-load of slime's converter output (release), a save in Megatron-LM's layout (iter_0000000 /
    iter_0000001), --ref-ckpt-step and --load / --ckpt-step of it."""
    from slime.backends.megatron_utils.parallel import destroy_model_parallel

    def trainer(*flags, with_ref=False, port_offset=0):
        destroy_model_parallel()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        return make_trainer(make_megatron_args(hf, "--lr", "1e-2", *flags), port=port + port_offset,
                            with_ref=with_ref)

    original = dict(trainer().backend.hf_weights(None))
    # --ref-load of slime's converter output, --load empty: the policy starts from it too (slime's rule)
    trained = trainer("--use-kl-loss", "--ref-load", release_root, "--save", save, "--load", save, with_ref=True,
                      port_offset=1)
    trained.snapshot.restore("ref")
    ref = dict(trained.backend.hf_weights(None))
    trained.snapshot.restore("actor")
    start = trained.start_rollout_id
    steps = []
    for rollout_id in (0, 1):
        trained.train(rollout_id, make_train_data(4, vocab_size=300, seed=20 + rollout_id))
        trained.save_model(rollout_id, run_state={"data_source": {}})
        steps.append(dict(trained.backend.hf_weights(None)))
    ref_step0 = trainer("--use-kl-loss", "--ref-load", save, "--ref-ckpt-step", "0", with_ref=True, port_offset=2)
    ref_step0.snapshot.restore("ref")
    ref_at_step0 = dict(ref_step0.backend.hf_weights(None))
    ref_step0.snapshot.restore("actor")
    policy_from_ref = dict(ref_step0.backend.hf_weights(None))  # no --load: the policy starts from --ref-load
    resumed = trainer("--load", save, port_offset=3)
    resumed_step0 = trainer("--load", save, "--ckpt-step", "0", port_offset=4)
    # slime's own save: the same folder without this project's run state beside the torch_dist files
    foreign = save.parent / "slime_save"
    shutil.copytree(save, foreign)
    for folder in foreign.glob("iter_*"):
        for extra in ("meta.json", "run_state.json", "scheduler.pt", "rng", *HF_FILES):
            shutil.rmtree(folder / extra) if (folder / extra).is_dir() else (folder / extra).unlink(missing_ok=True)
        _as_megatron_lm_saves_it(folder / "common.pt")
    from_slime = trainer("--load", foreign, port_offset=5)
    from_release = trainer("--load", release_root, port_offset=6)  # the converter's: weights to start rollout 0 from
    result = {"original": original, "ref": ref, "start": start, "steps": steps, "ref_at_step0": ref_at_step0,
              "policy_from_ref": policy_from_ref,
              "resumed": (resumed.start_rollout_id, dict(resumed.backend.hf_weights(None))),
              "resumed_step0": (resumed_step0.start_rollout_id, dict(resumed_step0.backend.hf_weights(None))),
              "from_slime": (from_slime.start_rollout_id, dict(from_slime.backend.hf_weights(None))),
              "from_release": (from_release.start_rollout_id, dict(from_release.backend.hf_weights(None)))}
    destroy_model_parallel()
    return result


def _as_megatron_lm_saves_it(common_file: Path) -> None:
    """common.pt as Megatron-LM writes it: its `args` hold megatron enums and torch dtypes, its content metadata is
    Megatron-LM's (dp_reshardable optimizer, no singleton shards)."""
    from megatron.core.transformer.enums import AttnBackend

    common = torch.load(common_file, weights_only=False)
    common["args"].attention_backend, common["args"].params_dtype = AttnBackend.auto, torch.bfloat16
    common["content_metadata"] = {"distrib_optim_sharding_type": "dp_reshardable", "singleton_local_shards": False,
                                  "chained_optim_avoid_prefix": True}
    torch.save(common, common_file)


def _equal(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[name], b[name]) for name in a)


def test_ref_load_and_load_read_megatron_lm_checkpoints(models, tmp_path):
    save = tmp_path / "save"
    result = run_distributed(_reads_megatron_lm_checkpoints, 1, models["dense"], models["dense_slime"], save)[0]
    assert _equal(result["ref"], result["original"]) and result["start"] == 0
    assert not _equal(result["steps"][0], result["original"])  # the steps changed the weights
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert {p.name for p in save.iterdir()} == {"latest_checkpointed_iteration.txt", "iter_0000000", "iter_0000001"}
    assert _equal(result["ref_at_step0"], result["steps"][0])
    assert _equal(result["policy_from_ref"], result["steps"][0])
    assert result["resumed"][0] == 2 and _equal(result["resumed"][1], result["steps"][1])
    assert result["resumed_step0"][0] == 1 and _equal(result["resumed_step0"][1], result["steps"][0])
    assert result["from_slime"][0] == 2 and _equal(result["from_slime"][1], result["steps"][1])
    assert result["from_release"][0] == 0 and _equal(result["from_release"][1], result["original"])


def test_a_release_or_iteration_folder_is_a_path_of_its_own(models, tmp_path):
    from slime.utils.checkpoint_state import weights_at_step

    root = tmp_path / "ckpt"
    shutil.copytree(models["dense_slime"], root)
    shutil.copytree(root / "release", root / "iter_0000003")
    for folder in (root / "release", root / "iter_0000003"):
        args = parse_args(_argv(models["dense"], tmp_path, "--use-kl-loss", "--ref-load", folder))
        assert weights_at_step(args.ref_load, None, "--ref-ckpt-step") == str(folder)
    assert weights_at_step(str(root / "release"), 3, "--ref-ckpt-step") == str(root / "iter_0000003")


def _prompts(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"input": "1+1", "label": "2"}\n')
    return path


def _argv(hf, tmp_path, *extra):
    return ["--hf-checkpoint", str(hf), "--train-backend", "megatron", "--rollout-batch-size", "2", "--num-rollout",
            "1", "--rm-type", "math", "--prompt-data", str(_prompts(tmp_path)), *map(str, extra)]


def test_missing_iteration_folders_are_errors_naming_the_file_and_iteration(models, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(models["dense_slime"], root)
    (root / "latest_checkpointed_iteration.txt").write_text("5")
    for flag in ("--ref-load", "--load"):
        extra = ("--use-kl-loss",) if flag == "--ref-load" else ()
        with pytest.raises(ArgumentError, match=rf"{flag} .*iter_0000005 of .*latest_checkpointed_iteration.txt \(it "
                                                r"names iteration 5\) does not exist.*holds: release"):
            parse_args(_argv(models["dense"], tmp_path, flag, root, *extra))
    with pytest.raises(ArgumentError, match=r"iter_0000007 of the step 7 .*does not exist"):
        parse_args(_argv(models["dense"], tmp_path, "--use-kl-loss", "--ref-load", root, "--ref-ckpt-step", 7))
    (root / "latest_checkpointed_iteration.txt").write_text("release")
    args = parse_args(_argv(models["dense"], tmp_path, "--use-kl-loss", "--ref-load", root))
    assert args.ref_load == str(root)


def test_the_fsdp_backend_refuses_a_megatron_checkpoint(models, tmp_path):
    argv = _argv(models["dense"], tmp_path, "--use-kl-loss", "--ref-load", models["dense_slime"])
    argv[argv.index("megatron")] = "fsdp"
    with pytest.raises(ArgumentError, match="--ref-load .*--train-backend fsdp cannot read.*convert_torch_dist_to_hf"):
        parse_args(argv)


def _load_into_another_architecture(rank, world_size, port, hf, torch_dist):
    from slime.backends.megatron_utils.checkpoint import load_model_weights
    from slime.backends.megatron_utils.parallel import destroy_model_parallel
    from slime.utils.checkpoint_state import CheckpointError
    from tests.helpers.megatron_helpers import build_megatron

    chunks, _ = build_megatron(make_megatron_args(hf), rank, world_size, port)
    try:
        load_model_weights(torch_dist, chunks)
    except CheckpointError as exc:
        return str(exc)
    finally:
        destroy_model_parallel()
    return None


def test_a_checkpoint_lacking_weights_of_the_model_is_an_error_naming_them(models, tmp_path):
    from slime.utils.tiny_model import build_tiny_model

    qwen2 = build_tiny_model(tmp_path / "qwen2", arch="qwen2", seed=3, vocab_size=300)  # q/k/v biases, no q/k norm
    message = run_distributed(_load_into_another_architecture, 1, qwen2, models["dense_slime"])[0]
    assert message is not None and "another architecture" in message
    assert "it lacks 1 weight(s), e.g. decoder.layers.self_attention.linear_qkv.bias" in message
    assert ("this model has no 2 weight(s), e.g. decoder.layers.self_attention.k_layernorm.weight, "
            "decoder.layers.self_attention.q_layernorm.weight") in message
