"""Ray start-up and device placement: one placement group whose bundles are the devices.

On GPU machines a bundle is `{"GPU": 1, "CPU": 1}`; without a GPU a bundle is `{"CPU": 1}` standing for one CPU
"device", so `--actor-num-gpus-per-node 2` means two CPU trainer processes. Colocated runs put trainer and engine
on the same bundles; disaggregated runs give the engines their own bundles after the trainer's.

A local run (no `--ray-address`) is a private single-host cluster bound to loopback: Ray's GCS, raylet, workers,
agents and metrics ports, and the trainer's gloo / NCCL sockets, listen on 127.0.0.1 only (docs/guides/security.md,
"What listens where").
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import ray
from ray._private import ray_constants
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
# gloo and NCCL pick the interface their sockets listen on by these; "lo" keeps a local run's on loopback.
COLLECTIVE_SOCKET_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")

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
    """Join `--ray-address` if given (the cluster's own token auth applies), else start a local cluster sized for
    this run, bound to loopback."""
    if ray.is_initialized():
        return
    env_vars = {"TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    if args.ray_address:
        if os.environ.get("RAY_AUTH_MODE") == "disabled":
            logger.warning("--ray-address %s with RAY_AUTH_MODE=disabled: Ray token auth is off, so anyone who can "
                           "reach the cluster's ports can run code on it; unset RAY_AUTH_MODE (docs/guides/security.md)",
                           args.ray_address)
        ray.init(address=args.ray_address, runtime_env={"env_vars": env_vars}, log_to_driver=True)
        return
    # Ray's switch for a cluster of one machine (meant for laptops, read when ray is imported): without it Ray turns
    # 127.0.0.1 into the machine's address and its servers listen there or on every interface.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # the GCS, raylet and workers started below
    ray_constants.ENABLE_RAY_CLUSTER = False  # this process, which imported ray already
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # no one off this machine can reach a loopback cluster
    env_vars.update({name: os.environ.get(name, "lo") for name in COLLECTIVE_SOCKET_ENV})
    num_devices = _num_devices(args)
    num_cpus = max(os.cpu_count() or 1, num_devices + 4)  # logical CPUs: bundles + manager + slack
    kwargs = {"num_cpus": num_cpus, "include_dashboard": False, "dashboard_host": LOOPBACK,
              "runtime_env": {"env_vars": env_vars}}
    if args.device == "cuda":
        import torch

        kwargs["num_gpus"] = torch.cuda.device_count()
    ray.init(**kwargs)
    node_ip = ray.util.get_node_ip_address()
    if node_ip != LOOPBACK:
        logger.warning("the local Ray cluster listens beyond loopback, on %s: this Ray version ignored "
                       "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (docs/guides/security.md)", node_ip)


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
