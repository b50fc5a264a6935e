"""TrainBackend: what a training backend (FSDP2, Megatron) provides to the one train flow (train_flow.py).

The flow owns everything that is not backend-specific: which log-prob passes run and with which weights,
advantages and returns, the loss functions and their global denominators, the reference update interval, the
metrics. A backend owns the model: how it is built from a Hugging Face folder, how a list of packed micro-batches
goes forward (only, or with a backward of a loss the flow supplies), one optimizer step, the weight tensors this
process holds (the flow keeps host copies of them to switch between actor, reference, teacher and old actor), the
HF-named full weights for the engines, checkpoints, and offload.

Data parallelism: the flow reduces sums and counts over the data-parallel group only (`all_reduce`), since ranks
that split one model (tensor or pipeline parallel peers) hold the same samples.

A backend builds either a policy (`build_policy`, trained by train_flow.py) or a PPO critic (`build_critic`, trained
by critic_flow.py).

Not here: the Ray actor (slime/ray/actor_group.py), the loss math (loss.py, ppo_utils), packing (packing.py).
"""

from __future__ import annotations

import contextlib
import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from slime.backends.packing import PackedMicroBatch
from slime.backends.routing_replay import RoutingReplay

logger = logging.getLogger(__name__)

# outputs of one micro-batch's forward: (log_probs, entropy) for a policy, values for a critic
Outputs = object
# loss_of(index of the micro-batch in the list, its outputs) -> (this micro-batch's share of the loss, metrics)
LossOf = Callable[[int, Outputs], tuple[torch.Tensor, dict]]


def reset_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """A torch Adam's step counts and moments to zero, in place."""
    for group in optimizer.param_groups:
        if "step" in group:
            group["step"] = 0
    for state in optimizer.state.values():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            value = state.get(key)
            if isinstance(value, torch.Tensor):
                value.zero_()
            elif value is not None:
                state[key] = 0


class TrainBackend(ABC):
    """One training process of a backend. Attributes the flow reads: `device`, `model` (passed to user hooks),
    `optimizer`, `scheduler`, `hf_config`, `dp_rank`, `dp_size`, `num_micro_batches_multiple` (the schedule gives
    every optimizer step a multiple of it in micro-batches), `routing_replay` (the RoutingReplay an MoE
    policy's routers consult, None for a dense model or a backend without replay; the backend runs each
    micro-batch's forward and backward inside `routing_of(micro_batch)`, or, where a pipeline schedule interleaves
    micro-batches, enters the replay's contexts itself)."""

    device: torch.device
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    hf_config: object
    dp_rank: int = 0
    dp_size: int = 1
    dp_group = None  # None: the default group
    routing_replay: RoutingReplay | None = None
    num_micro_batches_multiple: int = 1  # every step's micro-batch count is a multiple (an interleaved pipeline's)
    hf_weights_on_every_rank: bool = False  # `hf_weights` yields the same full tensors on every rank (FSDP)

    def routing_of(self, micro_batch: PackedMicroBatch):
        """The context of one micro-batch's forward (and backward) for routing replay."""
        if self.routing_replay is None:
            return contextlib.nullcontext()
        return self.routing_replay.micro_batch(micro_batch.routed_experts)

    # ----------------------------------------------------------------------------------------- building
    @abstractmethod
    def build_policy(self, weights_path: str) -> None:
        """Policy model, optimizer and schedule from `weights_path` (an HF folder or this backend's checkpoint)."""

    @abstractmethod
    def build_critic(self, weights_path: str) -> None:
        """The PPO critic's value model (the policy's body under a hidden -> 1 value head instead of the output
        layer), optimizer at --critic-lr and schedule, from `weights_path`: an HF folder (its `value_head.weight`
        fills the head when present, else the head starts at zero) or this backend's critic checkpoint. Its
        `forward_only` then gives one fp32 value per response token of each micro-batch, and `forward_backward`
        hands those to `loss_of`."""

    @abstractmethod
    def load_hf_weights(self, path: str) -> None:
        """Overwrite the model's weights with those of an HF folder of the same architecture (ref, teacher)."""

    @abstractmethod
    def resolve_load_dir(self, load: str | None) -> Path | None:
        """The complete checkpoint under `--load` to resume from, or None."""

    @abstractmethod
    def load_training_state(self, resume_dir: Path) -> int:
        """Optimizer, schedule and RNG state of a checkpoint; returns its rollout id."""

    @abstractmethod
    def save_checkpoint(self, rollout_id: int, run_state: dict | None, save_root: str | None = None) -> str:
        """Collective: an atomic checkpoint of this rollout under `save_root` (default --save; the critic's:
        `{save}/critic`), with the driver's `run_state`."""

    # ---------------------------------------------------------------------------------------- compute
    @abstractmethod
    def forward_only(self, micro_batches: list[PackedMicroBatch]) -> list[Outputs]:
        """No-grad forward of each micro-batch in eval mode; on every rank of the data-parallel replica."""

    @abstractmethod
    def forward_backward(self, micro_batches: list[PackedMicroBatch], loss_of: LossOf) -> list[dict]:
        """Forward and backward of each micro-batch's loss (gradients accumulate, averaged over the data-parallel
        group as the loss is a share of the global sum); the metrics loss_of returned, one dict per micro-batch, on
        every rank of the replica (a pipeline backend sends the last stage's to the others)."""

    @abstractmethod
    def clip_grad_norm(self, max_grad_norm: float) -> float:
        """The global L2 norm of the gradients (over every shard of the model), clipped in place to
        `max_grad_norm` when that is finite."""

    def optimizer_step(self, max_grad_norm: float) -> dict:
        """Clip, step (skipped on a non-finite norm), advance the schedule, zero the gradients:
        {"grad_norm", "lr"}."""
        grad_norm = self.clip_grad_norm(max_grad_norm)
        lr = self.optimizer.param_groups[0]["lr"]
        if math.isfinite(grad_norm):
            self.apply_clipped_grads()
        else:
            logger.warning("non-finite grad norm %s: optimizer step skipped", grad_norm)
        self.scheduler.step()
        self.zero_grad()
        return {"grad_norm": grad_norm, "lr": lr}

    def apply_clipped_grads(self) -> None:
        """The optimizer's update from the gradients `clip_grad_norm` left."""
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def reset_optimizer_states(self) -> None:
        """slime's --reset-optimizer-states: AdamW's step counts and moments back to zero (in place, so offload and
        checkpoints see the same tensors); the learning-rate schedule goes on."""
        reset_adam_state(self.optimizer)

    # ---------------------------------------------------------------------------------------- weights
    @abstractmethod
    def local_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This process's own parameter tensors (shards), in place: the flow copies them to and from the host."""

    @abstractmethod
    def hf_weights(self, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective: (HF name, full tensor) of every weight, on the rank that sends them to the engines (rank 0);
        other ranks take part in the gathers and may yield nothing or the same. Never a parameter's own storage."""

    def adapters_disabled(self):
        """LoRA (--lora-rank > 0): a context inside which the model computes its frozen base alone (the reference
        model, and the pass of a teacher loaded into the base)."""
        raise NotImplementedError(f"{type(self).__name__} does not train LoRA adapters")

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        """LoRA, collective: the full adapter {HF name (`...q_proj.lora_A.weight`): fp32 CPU tensor} on every
        rank."""
        raise NotImplementedError(f"{type(self).__name__} does not train LoRA adapters")

    def num_trainable_parameters(self) -> int:
        """Collective: the values the optimizer trains, each counted once however it is sharded or replicated."""
        raise NotImplementedError(f"{type(self).__name__} does not count its trainable parameters")

    # ---------------------------------------------------------------------------------------- memory
    def prepare_offload(self) -> None:
        """The rollout's optimizer steps are done and an offload follows the weight push: a backend may start
        moving what the push does not read (FSDP: the optimizer state). Default: nothing."""

    def offload(self) -> None:
        """Move parameters and optimizer state to the host (GPU); nothing on the CPU."""

    def onload(self) -> None:
        """Back to the device after `offload`."""

    @property
    def offloaded(self) -> bool:
        """Whether the state is offloaded now: its device storages are empty (FSDP and Megatron offload by
        storage), so nothing may read it before `onload`."""
        return False

    def require_on_device(self, what: str) -> None:
        """Refuse `what` while offloaded: the device storages are empty, and reading them reads freed memory."""
        if self.offloaded:
            raise RuntimeError(f"{what} needs the trainer's state, which is offloaded: call onload() first")

    @contextlib.contextmanager
    def resident(self):
        """The state on the device inside the block (onloaded and offloaded again around it when offloaded): for a
        checkpoint of an offloaded model (the PPO critic is saved between its updates)."""
        was_offloaded = self.offloaded
        if was_offloaded:
            self.onload()
        try:
            yield
        finally:
            if was_offloaded:
                self.offload()

    # ---------------------------------------------------------------------------------------- collectives
    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """In-place reduction over the data-parallel group (a no-op on one replica)."""
        if self.dp_size > 1:
            dist.all_reduce(tensor, op=op, group=self.dp_group)
        return tensor

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
