"""TrainData, the typed seam between the rollout manager and the trainers: the dict the rollout manager builds and
splits has exactly TrainData's keys (every optional one present when every sample carries its field), each value of
the declared shape, and every key the trainers read is declared."""

import re
import typing
from pathlib import Path

import numpy as np
import pytest

from slime.ray.train_data import assign_rollout_ids, samples_to_train_data, split_train_data
from slime.utils.train_data_types import TrainData
from slime.utils.types import Sample, Status
from tests.helpers.args_helpers import make_args

REPO = Path(__file__).resolve().parents[2]
SCALARS = {"rollout_id", "num_steps_per_rollout", "global_batch_size"}


@pytest.fixture(scope="module")
def args():
    return make_args("--rollout-batch-size", 2, "--n-samples-per-prompt", 4, "--global-batch-size", 8)


def full_samples(num_groups: int = 2, group_size: int = 4) -> list[Sample]:
    samples = []
    for index in range(num_groups * group_size):
        n = 3 + index % 3
        samples.append(Sample(group_index=index // group_size, index=index, tokens=list(range(4 + n)),
                              response_length=n, reward=float(index % 2), rollout_log_probs=[-0.5] * n,
                              teacher_log_probs=[-0.7] * n, weight_versions=["1", "2"],
                              rollout_routed_experts=np.zeros((3 + n, 2, 2), dtype=np.int32),
                              status=Status.TRUNCATED if index == 0 else Status.COMPLETED))
    assign_rollout_ids(samples)  # as the rollout manager does before the conversion
    return samples


def with_images_and_adapters(args, samples: list[Sample]):
    """The keys only some runs have: images (vision-language samples) and --lora-adapter-key (several adapters)."""
    import copy

    import torch

    args = copy.copy(args)
    args.lora_adapter_key, args.lora_adapter_names = "task", ["add", "sub"]
    for sample in samples:
        sample.metadata["lora_adapter"] = ["add", "sub"][sample.group_index % 2]
        sample.multimodal_train_inputs = {"pixel_values": torch.zeros(4, 6), "image_grid_thw": torch.tensor([[1, 2, 2]])}
    return args, samples


def test_the_train_data_has_exactly_the_declared_keys(args):
    declared = set(TrainData.__annotations__)
    args, samples = with_images_and_adapters(args, full_samples())
    data = samples_to_train_data(args, samples)
    assert set(data) == declared - SCALARS
    per_rank, dropped = split_train_data(args, data, rollout_id=3)
    assert dropped == 0
    for rank_data in per_rank:
        assert set(rank_data) == declared
        assert rank_data["rollout_id"] == 3 and rank_data["global_batch_size"] == 8


def test_optional_keys_are_absent_when_a_sample_lacks_the_field(args):
    samples = full_samples()
    samples[1].rollout_log_probs = samples[1].teacher_log_probs = None
    samples[1].weight_versions = []
    for sample in samples:
        sample.rollout_routed_experts = None
    data = samples_to_train_data(args, samples)
    assert not {"rollout_log_probs", "teacher_log_probs", "weight_versions", "rollout_routed_experts"} & set(data)


def test_values_have_the_declared_shape(args):
    data = samples_to_train_data(args, full_samples())
    hints = typing.get_type_hints(TrainData)
    for key, values in data.items():
        assert typing.get_origin(hints[key]) is list, key
        assert len(values) == 8, key
        (element,) = typing.get_args(hints[key])
        origin = typing.get_origin(element) or element
        if origin is list:
            assert all(isinstance(v, list) for v in values), key
        elif origin in (int, float, str):
            assert all(isinstance(v, origin) for v in values), key
    assert data["truncated"] == [1] + [0] * 7
    assert [len(m) for m in data["loss_masks"]] == data["response_lengths"]


def test_every_key_the_trainers_read_is_declared():
    read = set()
    for path in (REPO / "slime" / "backends").rglob("*.py"):
        read |= set(re.findall(r"\bdata(?:\.get\(|\[)\"(\w+)\"", path.read_text()))
    assert read and read <= set(TrainData.__annotations__), read - set(TrainData.__annotations__)
