"""On a GPU machine: the placement group's bundles in (node, GPU id) order, and engine i of N devices given GPUs
[i*N, (i+1)*N) of the rollout's, the same GPUs trainer ranks i*N .. (i+1)*N-1 sit on when colocated."""

import pytest
import ray
import torch

from slime.ray.placement_group import create_placement_groups, init_ray
from tests.helpers.args_helpers import make_args


@pytest.mark.gpu
def test_engines_of_two_gpus_take_consecutive_devices_of_one_node(tmp_path):
    num_gpus = torch.cuda.device_count()
    if num_gpus < 2:
        pytest.skip("needs two GPUs")
    per_engine, num_devices = 2, num_gpus - num_gpus % 2
    args = make_args("--device", "cuda", "--actor-num-gpus-per-node", num_devices, "--colocate",
                     "--rollout-num-gpus-per-engine", per_engine, "--output-dir", tmp_path)
    init_ray(args)
    try:
        placement = create_placement_groups(args)
        actor, rollout = placement["actor"], placement["rollout"]
        assert actor.device_ids == sorted(actor.device_ids, key=int) and len(set(actor.device_ids)) == num_devices
        for engine in range(num_devices // per_engine):
            devices = rollout.engine_device_ids(engine, per_engine)
            assert devices == actor.device_ids[engine * per_engine:(engine + 1) * per_engine]
    finally:
        ray.shutdown()
