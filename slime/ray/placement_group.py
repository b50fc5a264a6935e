"""Ray start-up and device placement: one placement group whose bundles are the devices.

On GPU machines a bundle is `{"GPU": 1, "CPU": 1}`; without a GPU a bundle is `{"CPU": 1}` standing for one CPU
"device", so `--actor-num-gpus-per-node 2` means two CPU trainer processes. Colocated runs put trainer and engine
on the same bundles; disaggregated runs give the engines their own bundles after the trainer's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

# Fractions of one bundle taken by each kind of actor, so trainer and engine fit one device when colocated.
TRAIN_ACTOR_FRACTION = 0.4
ENGINE_ACTOR_FRACTION = 0.2


@dataclass
class DevicePlacement:
    pg: object
    bundle_indices: list[int]
    use_gpu: bool

    def strategy(self, i: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(
            placement_group=self.pg,
            placement_group_bundle_index=self.bundle_indices[i],
            placement_group_capture_child_tasks=True,
        )

    def resources(self, fraction: float) -> dict:
        return {"num_cpus": fraction, "num_gpus": fraction if self.use_gpu else 0}


def init_ray(args) -> None:
    """Join `--ray-address` if given, else start a local cluster sized for this run."""
    if ray.is_initialized():
        return
    env_vars = {"TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    if args.ray_address:
        ray.init(address=args.ray_address, runtime_env={"env_vars": env_vars}, log_to_driver=True)
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private loopback cluster owned by this process
    num_devices = _num_devices(args)
    num_cpus = max(os.cpu_count() or 1, num_devices + 4)  # logical CPUs: bundles + manager + slack
    kwargs = {"num_cpus": num_cpus, "include_dashboard": False, "runtime_env": {"env_vars": env_vars}}
    if args.device == "cuda":
        import torch

        kwargs["num_gpus"] = torch.cuda.device_count()
    ray.init(**kwargs)


def _num_devices(args) -> int:
    num_rollout = 0 if args.debug_train_only else args.rollout_num_gpus
    if args.colocate:
        return max(args.world_size, num_rollout)
    return args.world_size + num_rollout


def create_placement_groups(args) -> dict[str, DevicePlacement]:
    use_gpu = args.device == "cuda"
    num_devices = _num_devices(args)
    bundle = {"GPU": 1, "CPU": 1} if use_gpu else {"CPU": 1}
    pg = placement_group([dict(bundle) for _ in range(num_devices)], strategy="PACK")
    ray.get(pg.ready(), timeout=120)
    actor_indices = list(range(args.world_size))
    rollout_offset = 0 if args.colocate else args.world_size
    num_rollout = 0 if args.debug_train_only else args.rollout_num_gpus
    rollout_indices = list(range(rollout_offset, rollout_offset + num_rollout))
    return {
        "actor": DevicePlacement(pg, actor_indices, use_gpu),
        "rollout": DevicePlacement(pg, rollout_indices, use_gpu),
    }
