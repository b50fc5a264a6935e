"""RayTrainGroup: one trainer Ray actor per device, driven together.

Every call fans out to all ranks (they run collectives together) and returns rank 0's answer; the trainer
all-reduces its metrics, so rank 0 speaks for the group. The trainer class is imported inside the actor, so the
driver never imports the training backend.
"""

from __future__ import annotations

import os

import ray

from slime.ray.placement_group import TRAIN_ACTOR_FRACTION, DevicePlacement
from slime.utils.misc import find_free_port


class TrainRayActor:
    def __init__(self, args, rank: int, world_size: int, master_addr: str, master_port: int, role: str):
        if args.device == "cpu":
            import torch

            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        from slime.backends.fsdp_utils.actor import FSDPTrainer

        self.trainer = FSDPTrainer(args, rank, world_size, master_addr, master_port, role=role)

    def call(self, method: str, *args, **kwargs):
        return getattr(self.trainer, method)(*args, **kwargs)

    def train(self, rollout_id: int, data: dict):
        return self.trainer.train(rollout_id, data)


class RayTrainGroup:
    def __init__(self, args, placement: DevicePlacement, role: str = "actor"):
        self.args = args
        self.role = role
        world_size = args.world_size
        master_addr = "127.0.0.1" if args.actor_num_nodes == 1 else ray.util.get_node_ip_address()
        master_port = find_free_port()
        actor_cls = ray.remote(TrainRayActor)
        self.actors = [
            actor_cls.options(scheduling_strategy=placement.strategy(rank),
                              **placement.resources(TRAIN_ACTOR_FRACTION)).remote(
                args, rank, world_size, master_addr, master_port, role)
            for rank in range(world_size)
        ]

    def _all(self, method: str, *args, **kwargs) -> list:
        return ray.get([actor.call.remote(method, *args, **kwargs) for actor in self.actors])

    def init(self, with_ref: bool) -> int:
        """Build models and optimizer on every rank; returns the rollout id to start from."""
        return self._all("init", with_ref)[0]

    def async_train(self, rollout_id: int, data_refs: list) -> list:
        # Each rank gets its own ObjectRef as a top-level argument, so Ray hands it the dict directly.
        return [actor.train.remote(rollout_id, ref) for actor, ref in zip(self.actors, data_refs)]

    def train(self, rollout_id: int, data_refs: list) -> dict:
        return ray.get(self.async_train(rollout_id, data_refs))[0]

    def save_model(self, rollout_id: int, run_state: dict | None = None) -> None:
        self._all("save_model", rollout_id, run_state)

    def update_weights(self, engine_urls: list[str], weight_version: str) -> dict:
        return self._all("update_weights", engine_urls, weight_version)[0]

    def offload(self) -> None:
        self._all("offload")

    def onload(self) -> None:
        self._all("onload")
