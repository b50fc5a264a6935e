"""The train flow over the Megatron backend: at TP=1 one rollout's optimizer steps give the FSDP trainer's losses,
gradients and parameters; a torch_dist checkpoint saved at TP=2 (2 gloo processes) resumes at TP=1 with the same
next step (model and optimizer state resharded), and the HF weights for the engines equal the checkpoint's."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from tests.helpers.fsdp_helpers import (
    capture_grads,
    full_params,
    make_args,
    make_train_data,
    make_trainer,
    run_distributed,
)
from tests.helpers.megatron_helpers import make_megatron_args

pytest.importorskip("megatron.core")

# The optimizer flags both backends default differently (as slime's Megatron and FSDP do) given explicitly.
ALGORITHM = ("--lr", "1e-3", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--adam-beta2", "0.98",
             "--weight-decay", "0.01", "--entropy-coef", "0.01", "--micro-batch-size", "2", "--clip-grad", "0.5")


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    from slime.utils.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_backend"), arch="qwen3", seed=2)


def _hf_grads(trainer) -> list[dict]:
    """Per optimizer step, the Megatron trainer's gradients under HF names."""
    from tests.helpers.megatron_helpers import hf_named_grads

    captured = []
    backend = trainer.backend
    backend.optimizer.optimizer.register_step_pre_hook(  # the inner torch optimizer: after clipping
        lambda optimizer, args, kwargs: captured.append(hf_named_grads(backend.model_chunks, backend.hf_config)))
    return captured


def _fsdp_and_megatron(rank, world_size, port, checkpoint):
    from slime.backends.megatron_utils.parallel import destroy_model_parallel

    data = make_train_data(8, vocab_size=300, seed=4, num_steps=2)
    fsdp = make_trainer(make_args(checkpoint, *ALGORITHM), port=port)
    fsdp_grads = capture_grads(fsdp)
    fsdp_metrics = fsdp.train(0, data)
    fsdp_params = {name.removeprefix("hf_model."): value for name, value in full_params(fsdp).items()}
    dist.destroy_process_group()
    megatron = make_trainer(make_megatron_args(checkpoint, *ALGORITHM), port=port + 1)
    megatron_grads = _hf_grads(megatron)
    megatron_metrics = megatron.train(0, data)
    megatron_params = dict(megatron.backend.hf_weights(None))
    destroy_model_parallel()
    return fsdp_metrics, fsdp_grads, fsdp_params, megatron_metrics, megatron_grads, megatron_params


def test_tp1_train_steps_equal_fsdp(tiny_checkpoint):
    fsdp_metrics, fsdp_grads, fsdp_params, metrics, grads, params = run_distributed(
        _fsdp_and_megatron, 1, tiny_checkpoint)[0]
    for key in ("train/loss", "train/pg_loss", "train/entropy_loss", "train/grad_norm", "train/lr"):
        assert metrics[key] == pytest.approx(fsdp_metrics[key], rel=1e-5, abs=1e-7), key
    assert len(grads) == len(fsdp_grads) == 2
    for step, (step_grads, reference) in enumerate(zip(grads, fsdp_grads)):
        for name, grad in step_grads.items():
            torch.testing.assert_close(grad, reference[f"hf_model.{name}"], rtol=1e-4, atol=1e-6,
                                       msg=f"step {step}: {name}")
    assert set(params) == set(fsdp_params) - {"lm_head.weight"}  # tied: the engines load one copy
    for name, value in params.items():
        torch.testing.assert_close(value, fsdp_params[name], rtol=0, atol=2e-5, msg=name)


def _train_save_train(rank, world_size, port, checkpoint, save, data, parallel, extra=()):
    from safetensors.torch import load_file

    trainer = make_trainer(make_megatron_args(checkpoint, *ALGORITHM, "--save", save, "--save-hf",
                                              f"{save}_hf/step_{{rollout_id}}", *extra, world_size=world_size,
                                              **parallel),
                           rank, world_size, port)
    exported = dict(trainer.backend.hf_weights(None))
    if rank == 0:
        original = load_file(str(checkpoint / "model.safetensors"))
        assert set(exported) == set(original) and all(torch.equal(exported[k], original[k]) for k in original)
    else:
        assert exported == {}
    trainer.train(0, data[0])
    trainer.save_model(0, run_state={"data_source": {}})
    metrics = trainer.train(1, data[1])
    return metrics, dict(trainer.backend.hf_weights(None))


def _resume(rank, world_size, port, checkpoint, save, data):
    trainer = make_trainer(make_megatron_args(checkpoint, *ALGORITHM, "--load", save), rank, world_size, port)
    start = trainer.start_rollout_id
    return start, trainer.train(1, data[1]), dict(trainer.backend.hf_weights(None))


def test_torch_dist_checkpoint_saved_at_tp2_resumes_at_tp1(tiny_checkpoint, tmp_path):
    save = tmp_path / "save"
    data = [make_train_data(8, vocab_size=300, seed=s, num_steps=2) for s in (11, 12)]
    results = run_distributed(_train_save_train, 2, tiny_checkpoint, save, data,
                              {"tp": 2})
    uninterrupted, expected = results[0]
    meta = json.loads((save / "iter_0000000" / "meta.json").read_text())  # Megatron-LM's layout
    assert meta["format"] == "torch_dist" and meta["rollout_id"] == 0
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "0"
    from safetensors.torch import load_file

    saved_hf = load_file(str(tmp_path / "save_hf" / "step_0" / "model.safetensors"))  # --save-hf at rollout 0
    assert set(saved_hf) == set(expected) and (tmp_path / "save_hf" / "step_0" / "config.json").is_file()
    start, metrics, params = run_distributed(_resume, 1, tiny_checkpoint, save, data)[0]
    assert start == 1
    for key in ("train/loss", "train/pg_loss", "train/grad_norm", "train/lr"):
        assert metrics[key] == pytest.approx(uninterrupted[key], rel=1e-5, abs=1e-7), key
    for name, value in params.items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-5, msg=name)


@pytest.mark.slow  # ~50 s: the checkpoint's replicas and optimizer shards over data x context parallel ranks
def test_torch_dist_checkpoint_saved_at_cp2_resumes_at_cp1(tiny_checkpoint, tmp_path):
    save = tmp_path / "save"
    data = [make_train_data(8, vocab_size=300, seed=s, num_steps=2) for s in (13, 14)]
    results = run_distributed(_train_save_train, 2, tiny_checkpoint, save, data, {}, ("--context-parallel-size", "2"))
    (uninterrupted, expected), (other_metrics, _) = results
    assert other_metrics["train/loss"] == uninterrupted["train/loss"]
    start, metrics, params = run_distributed(_resume, 1, tiny_checkpoint, save, data)[0]
    assert start == 1 and set(params) == set(expected)
    for key in ("train/loss", "train/pg_loss", "train/grad_norm", "train/lr"):
        assert metrics[key] == pytest.approx(uninterrupted[key], rel=1e-5, abs=1e-7), key
    for name, value in params.items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-5, msg=name)


def test_save_hf_is_for_the_megatron_backend(tiny_checkpoint):
    from slime.config.errors import ArgumentError

    with pytest.raises(ArgumentError, match="--save-hf: the FSDP backend's --save folders are Hugging Face"):
        make_args(tiny_checkpoint, "--save-hf", "/tmp/unused_{rollout_id}")
