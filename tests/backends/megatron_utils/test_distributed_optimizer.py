"""megatron-core's distributed optimizer in the Megatron backend over 2 gloo processes at DP=2: each rank holds
half of the Adam state (ZeRO-1), two rollouts of optimizer steps give the losses and parameters of one process
(DP=1, the whole state in one place: test_megatron_backend.py checks that one against the FSDP trainer's torch
AdamW), and a torch_dist checkpoint saved at DP=2 resumes in one process with the same next rollout (the sharded
optimizer state gathered back to the whole)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.backends.megatron_utils.test_backend import ALGORITHM
from tests.helpers.fsdp_helpers import make_train_data, make_trainer, rank_slice, run_distributed
from tests.helpers.megatron_helpers import make_megatron_args

pytest.importorskip("megatron.core")

METRICS = ("train/loss", "train/pg_loss", "train/entropy_loss", "train/grad_norm", "train/lr")


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    from slime.utils.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_distopt"), arch="qwen3", seed=3)


def _rollouts():
    return [make_train_data(8, vocab_size=300, seed=seed, num_steps=2) for seed in (21, 22)]


def _adam_state_numel(optimizer) -> int:
    return sum(state["exp_avg"].numel() + state["exp_avg_sq"].numel()
               for inner in optimizer.chained_optimizers for state in inner.optimizer.state.values())


def _data_parallel_run(rank, world_size, port, checkpoint, save):
    from slime.backends.megatron_utils.parallel import destroy_model_parallel

    trainer = make_trainer(make_megatron_args(checkpoint, *ALGORITHM, "--save", save, world_size=world_size),
                           rank, world_size, port)
    backend = trainer.backend
    assert (backend.dp_rank, backend.dp_size) == (rank, 2)
    data = _rollouts()
    first = trainer.train(0, rank_slice(data[0], rank, world_size))
    model_numel = sum(param.numel() for param in backend.model.parameters())
    trainer.save_model(0, run_state={"data_source": {}})
    second = trainer.train(1, rank_slice(data[1], rank, world_size))
    params = dict(backend.hf_weights(None))
    destroy_model_parallel()
    return first, second, params, _adam_state_numel(backend.optimizer), model_numel


def _one_process_runs(rank, world_size, port, checkpoint, save):
    """Uninterrupted at DP=1, then resumed at DP=1 from the DP=2 checkpoint."""
    from slime.backends.megatron_utils.parallel import destroy_model_parallel

    data = _rollouts()
    reference = make_trainer(make_megatron_args(checkpoint, *ALGORITHM), port=port)
    first, second = reference.train(0, data[0]), reference.train(1, data[1])
    params = dict(reference.backend.hf_weights(None))
    adam_numel = _adam_state_numel(reference.backend.optimizer)
    destroy_model_parallel()
    dist.destroy_process_group()
    resumed = make_trainer(make_megatron_args(checkpoint, *ALGORITHM, "--load", save), port=port + 1)
    start = resumed.start_rollout_id
    resumed_metrics = resumed.train(1, data[1])
    resumed_params = dict(resumed.backend.hf_weights(None))
    destroy_model_parallel()
    return (first, second, params, adam_numel), (start, resumed_metrics, resumed_params)


def _assert_same_metrics(metrics, reference, what):
    for key in METRICS:
        assert metrics[key] == pytest.approx(reference[key], rel=1e-5, abs=1e-7), f"{what}: {key}"


def _assert_same_params(params, reference, what):
    assert set(params) == set(reference)
    for name, value in params.items():
        torch.testing.assert_close(value, reference[name], rtol=0, atol=1e-5, msg=f"{what}: {name}")


def test_dp2_shards_adam_state_steps_as_one_process_and_resumes_there(tiny_checkpoint, tmp_path):
    save = tmp_path / "save"
    ranks = run_distributed(_data_parallel_run, 2, tiny_checkpoint, save)
    (first, second, params, adam_numel), (start, resumed_metrics, resumed_params) = run_distributed(
        _one_process_runs, 1, tiny_checkpoint, save)[0]

    model_numel = ranks[0][4]
    assert adam_numel == 2 * model_numel  # one process: both moments of every parameter
    local = [rank[3] for rank in ranks]
    assert sum(local) == adam_numel  # the two ranks' slices partition the state
    assert all(0.4 * adam_numel < numel < 0.6 * adam_numel for numel in local), local

    dp_first, dp_second, dp_params = ranks[0][:3]
    for other, mine in zip(ranks[1][:2], (dp_first, dp_second)):  # the flow reduces the metrics over DP
        assert {key: other[key] for key in METRICS} == {key: mine[key] for key in METRICS}
    _assert_same_metrics(dp_first, first, "rollout 0")
    _assert_same_metrics(dp_second, second, "rollout 1")
    _assert_same_params(dp_params, params, "after two rollouts")
    assert ranks[1][2] == {}  # the engines' weights come from rank 0

    assert start == 1
    _assert_same_metrics(resumed_metrics, dp_second, "resumed rollout 1")
    _assert_same_params(resumed_params, dp_params, "resumed")
