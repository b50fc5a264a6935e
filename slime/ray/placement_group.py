"""Ray start-up and device placement: one placement group whose bundles are the devices.

On GPU machines a bundle is `{"GPU": 1, "CPU": 1}`; without a GPU a bundle is `{"CPU": 1}` standing for one CPU
"device", so `--actor-num-gpus-per-node 2` means two CPU trainer processes. Colocated runs put trainer and engine
on the same bundles; disaggregated runs give the engines their own bundles after the trainer's. The bundles are
ordered by (node, GPU id), as slime orders them, so that consecutive positions are neighbouring devices of a node.

An engine spans `--rollout-num-gpus-per-engine` N bundles: engine i takes the rollout's positions [i*N, (i+1)*N),
so in a colocated run trainer rank r's device hosts engine r // N's rank r % N (the weight push relies on it:
slime/backends/weight_sender.py). Its actor sits on the first of them and its server sees all N devices
(`engine_device_ids`); on the CPU the same bookkeeping holds with CPU bundles and no device ids.

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
    device_ids: list[str] | None = None  # per position: the bundle's GPU as a CUDA_VISIBLE_DEVICES entry (GPU only)
    node_ids: list[str] | None = None  # per position: the bundle's Ray node (GPU only)

    def engine_positions(self, engine: int, per_engine: int) -> list[int]:
        """The positions of engine `engine`'s bundles: [engine * per_engine, (engine + 1) * per_engine)."""
        positions = list(range(engine * per_engine, (engine + 1) * per_engine))
        if positions[-1] >= len(self.bundle_indices):
            raise ValueError(f"engine {engine} of {per_engine} devices needs rollout positions {positions}, but the "
                             f"rollout has {len(self.bundle_indices)} (--rollout-num-gpus)")
        return positions

    def engine_device_ids(self, engine: int, per_engine: int) -> list[str] | None:
        """The engine's devices as CUDA_VISIBLE_DEVICES entries (None on the CPU); RuntimeError naming the flags when
        they are not all on one node."""
        positions = self.engine_positions(engine, per_engine)
        if self.device_ids is None:
            return None
        nodes = {self.node_ids[p] for p in positions}
        if len(nodes) > 1:
            raise RuntimeError(f"engine {engine}'s {per_engine} devices (--rollout-num-gpus-per-engine) lie on "
                               f"{len(nodes)} nodes; an engine's ranks must share one node: make "
                               "--rollout-num-gpus-per-engine divide the GPUs of each node (--num-gpus-per-node)")
        return [self.device_ids[p] for p in positions]

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
    order, device_ids, node_ids = list(range(num_devices)), None, None
    if use_gpu:
        located = ray.get([_bundle_device.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=i)).remote() for i in range(num_devices)])
        order = sorted(range(num_devices), key=lambda i: (located[i][0], _numeric_first(located[i][1])))
        node_ids, device_ids = [located[i][0] for i in order], [located[i][1] for i in order]
    rollout_offset = 0 if args.colocate else args.world_size
    num_rollout = 0 if args.debug_train_only else args.rollout_num_gpus

    def positions(start: int, count: int) -> DevicePlacement:
        chosen = range(start, start + count)
        return DevicePlacement(pg, [order[p] for p in chosen], use_gpu,
                               device_ids and [device_ids[p] for p in chosen], node_ids and [node_ids[p] for p in chosen])

    return {"actor": positions(0, args.world_size), "rollout": positions(rollout_offset, num_rollout)}


@ray.remote(num_cpus=0.01, num_gpus=0.01)
def _bundle_device() -> tuple[str, str]:
    """(Ray node id, the GPU id Ray gave this task) of the bundle it runs in."""
    return ray.get_runtime_context().get_node_id(), str(ray.get_gpu_ids()[0])


def _numeric_first(device_id: str) -> tuple:
    return (0, int(device_id), "") if device_id.isdigit() else (1, 0, device_id)
