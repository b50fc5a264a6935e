"""RayTrainGroup: one trainer Ray actor per device, driven together.

Every call fans out to all ranks (they run collectives together) and returns rank 0's answer; the trainer
all-reduces its metrics, so rank 0 speaks for the group. The trainer class is imported inside the actor, so the
driver never imports the training backend. `train_with_critic` is PPO's actor/critic hand-over (spec 3.2e).

The ranks of a local run (no `--ray-address`) meet through a file in the run folder, not torch's TCPStore, which
listens on every interface; a run on a Ray cluster keeps the TCP rendezvous.
"""

from __future__ import annotations

import atexit
import copy
import logging
import os
import uuid
from pathlib import Path

import ray

from slime.backends.weight_push_result import WeightPushResult
from slime.ray.placement_group import TRAIN_ACTOR_FRACTION, DevicePlacement
from slime.ray.train_data import data_parallel_rank
from slime.ray.train_failures import get_from_ranks
from slime.utils.checkpoint_state import latest_checkpoint
from slime.utils.misc import find_free_port
from slime.utils.train_data_types import TrainData

logger = logging.getLogger(__name__)


def weight_update_mode(args) -> str:
    """A checkpoint folder the engines load with --update-weight-transport disk; else tensor handles (shared
    memory / CUDA IPC) when trainer and engines share devices or the host's memory, an NCCL broadcast group when
    the engines sit on GPUs of their own."""
    if args.update_weight_transport == "disk":
        return "disk"
    return "distributed" if args.device == "cuda" and not args.colocate else "tensor"


class TrainRayActor:
    def __init__(self, args, rank: int, world_size: int, master_addr: str, master_port: int, role: str,
                 rendezvous_file: Path | None = None):
        if args.device == "cpu":
            import torch

            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        if rendezvous_file is not None:  # the trainer then finds its default group made
            import torch.distributed as dist

            from slime.backends.process_group import PROCESS_GROUP_TIMEOUT

            backend = "nccl" if args.device == "cuda" else "gloo"
            dist.init_process_group(backend, init_method=f"file://{rendezvous_file}", rank=rank,
                                    world_size=world_size, timeout=PROCESS_GROUP_TIMEOUT)
        from slime.backends.factory import create_trainer

        self.trainer = create_trainer(args, rank, world_size, master_addr, master_port, role=role)

    # The trainer's methods the driver calls, one by one (ObjectRefs passed as top-level arguments arrive resolved).
    def init(self, with_ref: bool) -> int:
        return self.trainer.init(with_ref)

    def train(self, rollout_id: int, data: TrainData, *critic_targets) -> dict:
        """The policy's train step (`critic_targets` empty), or the critic's (values, returns)."""
        return self.trainer.train(rollout_id, data, *critic_targets)

    def compute_values(self, rollout_id: int, data: TrainData) -> list:
        return self.trainer.compute_values(rollout_id, data)

    def save_model(self, rollout_id: int, run_state: dict | None) -> str:
        return self.trainer.save_model(rollout_id, run_state)

    def update_weights(self, engine_urls: dict[int, str], weight_version: str, mode: str,
                       resident: bool = False) -> WeightPushResult:
        """Push to `engine_urls` ({engine index: URL}); `resident`: from whatever state the trainer is in (an offloaded one comes back for
        the push and leaves again)."""
        if resident:
            return self.trainer.update_weights_resident(engine_urls, weight_version, mode)
        return self.trainer.update_weights(engine_urls, weight_version, mode)

    def offload(self) -> None:
        self.trainer.offload()

    def onload(self) -> None:
        self.trainer.onload()

    def onload_beside(self, engines_release: list) -> bool:
        """The trainer's onload while the engines release their memory (`engines_release`: the release's ObjectRef
        in a list, so it arrives unresolved): at once if it fits in the free memory now, else after the release.
        Returns whether it ran beside the release."""
        beside = self.trainer.device_room.onload_fits_now()
        if not beside:
            ray.get(engines_release)
        self.trainer.onload()
        return beside

    @ray.method(num_returns=2)
    def train_for_critic(self, rollout_id: int, data: TrainData, values: list, train_policy: bool):
        """PPO actor: GAE from the critic's `values`; trains only if `train_policy`. Returns (metrics, returns)."""
        if not train_policy:
            return {}, self.trainer.returns_for_critic(rollout_id, data, values)
        metrics = self.trainer.train(rollout_id, data, values)
        return metrics, self.trainer.last_returns


def train_actor_options(args, placement, rank: int) -> dict:
    """Ray options of train rank `rank`: its bundle, its resources, and --train-env-vars in its environment."""
    options = {"scheduling_strategy": placement.strategy(rank), **placement.resources(TRAIN_ACTOR_FRACTION)}
    if args.train_env_vars:
        options["runtime_env"] = {"env_vars": {str(k): str(v) for k, v in args.train_env_vars.items()}}
    return options


class RayTrainGroup:
    def __init__(self, args, placement: DevicePlacement, role: str = "actor"):
        self.args = args
        self.role = role
        self.placement = placement
        self.with_ref = False
        if role == "actor" and weight_update_mode(args) == "distributed" and not args.debug_train_only:
            logger.warning("the weight broadcast group's rendezvous (a torch TCPStore on trainer rank 0) listens "
                           "beyond loopback, on every interface, while the trainer and the engines connect "
                           "(docs/guides/security.md)")
        self.actors = self._start_actors(args)

    def _start_actors(self, args) -> list:
        """One trainer process per rank, meeting at a fresh rendezvous."""
        world_size = args.world_size
        master_addr = "127.0.0.1" if args.actor_num_nodes == 1 else ray.util.get_node_ip_address()
        master_port = find_free_port()
        rendezvous_file = None
        if not args.ray_address:
            rendezvous_file = Path(args.output_dir).resolve() / f"rendezvous_{self.role}_{uuid.uuid4().hex[:8]}"
            atexit.register(rendezvous_file.unlink, missing_ok=True)  # the ranks are killed before they remove it
        actor_cls = ray.remote(TrainRayActor)
        return [actor_cls.options(**train_actor_options(args, self.placement, rank)).remote(
                    args, rank, world_size, master_addr, master_port, self.role, rendezvous_file)
                for rank in range(world_size)]

    def get(self, refs: list) -> list:
        """The ranks' results; a dead rank raises TrainActorDiedError naming it and the checkpoint to --load."""
        return get_from_ranks(refs, self.actors, self.role, self.args.save)

    def init(self, with_ref: bool) -> int:
        """Build models and optimizer on every rank; returns the rollout id to start from."""
        self.with_ref = with_ref
        return self.get([actor.init.remote(with_ref) for actor in self.actors])[0]

    def release(self) -> None:
        """--release-train: end every rank's process, and with it all the memory it held (slime's `release`);
        `recreate` starts them again from the run's last checkpoint."""
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
        logger.info("--release-train: the %s's train processes are released until the next train step", self.role)

    def recreate(self, rollout_id: int) -> None:
        """Start the released ranks again, from the latest checkpoint under --save (its optimizer state too, when
        saved), or from the run's first weights while none was saved; a no-op while they run."""
        if self.actors:
            return
        args = copy.copy(self.args)
        folder = latest_checkpoint(args.save)
        if folder is not None:
            args.load, args.no_load_optim = args.save, args.no_save_optim
        self.actors = self._start_actors(args)
        start_rollout_id = self.init(self.with_ref)
        if start_rollout_id != rollout_id:
            raise RuntimeError(f"--release-train: the train processes re-created from {folder or 'the initial weights'}"
                               f" would continue at rollout {start_rollout_id}, not {rollout_id}: a checkpoint under "
                               f"--save {args.save} is missing or newer than the run")
        logger.info("--release-train: the %s's train processes are back for rollout %d (from %s)", self.role,
                    rollout_id, folder or "the initial weights")

    def rank_data(self, data_refs: list) -> list:
        """Per process, the data of its data-parallel rank (tensor / pipeline peers share one)."""
        return [data_refs[data_parallel_rank(self.args, rank)] for rank in range(len(self.actors))]

    def async_train(self, rollout_id: int, data_refs: list) -> list:
        # Each rank gets its own ObjectRef as a top-level argument, so Ray hands it the dict directly.
        return [actor.train.remote(rollout_id, ref)
                for actor, ref in zip(self.actors, self.rank_data(data_refs))]

    def train(self, rollout_id: int, data_refs: list) -> dict:
        return self.get(self.async_train(rollout_id, data_refs))[0]

    def save_model(self, rollout_id: int, run_state: dict | None = None) -> None:
        self.get([actor.save_model.remote(rollout_id, run_state) for actor in self.actors])

    def update_weights(self, engine_urls: dict[int, str], weight_version: str,
                       resident: bool = False) -> WeightPushResult:
        """Push the weights to `engine_urls` ({engine index: URL}: an engine's index places its ranks on the
        trainer's devices, slime/backends/engine_ranks.py). `resident`: from whatever state the trainer is in (an offloaded one
        comes back for the push and leaves again: a restarted engine's weights, in the middle of a rollout)."""
        mode = weight_update_mode(self.args)
        return self.get([actor.update_weights.remote(engine_urls, weight_version, mode, resident)
                         for actor in self.actors])[0]

    def offload(self) -> None:
        self.get([actor.offload.remote() for actor in self.actors])

    def onload(self) -> None:
        self.get([actor.onload.remote() for actor in self.actors])

    def onload_beside(self, engines_release) -> bool:
        """Every rank's onload while the engines' release (an ObjectRef) is in flight (TrainRayActor.onload_beside);
        whether all of them ran beside it."""
        return all(self.get([actor.onload_beside.remote([engines_release]) for actor in self.actors]))


def train_with_critic(args, actor: RayTrainGroup, critic: RayTrainGroup, rollout_id: int, data_refs: list) -> dict:
    """One PPO rollout: the critic's values go to the actor (object refs, process rank to process rank: both groups
    have one layout), which computes GAE advantages and returns and trains once rollout_id >= --num-critic-only-steps;
    the critic then fits the returns. With --offload-train the critic holds its device memory only from its values
    to its update (its calls run in order). Returns rank 0's actor and critic metrics."""
    rank_data = critic.rank_data(data_refs)  # tensor / pipeline peers share their data-parallel rank's data
    if args.offload_train:
        critic.onload()
    value_refs = [c.compute_values.remote(rollout_id, ref) for c, ref in zip(critic.actors, rank_data)]
    train_policy = rollout_id >= args.num_critic_only_steps
    pairs = [a.train_for_critic.remote(rollout_id, ref, values, train_policy)
             for a, ref, values in zip(actor.actors, rank_data, value_refs)]
    critic_refs = [c.train.remote(rollout_id, ref, values, returns)
                   for c, ref, values, (_, returns) in zip(critic.actors, rank_data, value_refs, pairs)]
    metrics = actor.get([metric_ref for metric_ref, _ in pairs])[0]
    metrics.update(critic.get(critic_refs)[0])
    if args.offload_train:
        critic.offload()
    return metrics
