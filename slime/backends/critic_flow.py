"""CriticFlow: one training process of the PPO critic, a value model trained by its own train group, over any
backend that builds one (`TrainBackend.build_critic`: FSDP2's fsdp_utils/value_model.py, Megatron's
megatron_utils/value_head.py).

Per rollout (spec 3.2e / 4.5): `compute_values` (forward only, these are the "old" values) goes to the actor, which
computes the GAE advantages and returns; `train` then fits the values to those returns with the clipped value loss
over the same optimizer-step schedule and aggregation as the actor. Weights start from --critic-load or
--hf-checkpoint (value head at zero unless the folder has one); checkpoints go to `{save}/critic/`, resumed from
`{load}/critic/` (the rollout of the actor's checkpoint there).

Not here: the estimator math (ppo_utils / advantages.py), the value model (the backends) and the Ray hand-over
(slime/ray/actor_group.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NoReturn

import torch

from slime.backends.checkpoint_files import resolve_load_dir
from slime.backends.loss import LossReducer, MicroBatchTensors, value_loss
from slime.backends.packing import float_tensors, outputs_per_sample
from slime.backends.train_flow import TrainFlow
from slime.utils.checkpoint_state import CRITIC_SUBDIR, critic_checkpoint
from slime.utils.misc import seed_everything
from slime.utils.train_data_types import TrainData


def critic_resume_dir(load: str | None, step: int | None = None) -> Path | None:
    """The critic checkpoint of the same rollout as the actor's under --load (`{save}/critic/rollout_{id}`, or
    `iter_{id:07d}` in Megatron-LM's layout), checked complete; None when --load holds no actor checkpoint to resume
    from."""
    actor_dir = resolve_load_dir(load, step)
    return None if actor_dir is None else critic_checkpoint(actor_dir)


class CriticFlow(TrainFlow):
    """The critic's flow: the policy flow's schedule, optimizer step and metrics, with the value loss."""

    def __init__(self, args, backend, master_addr: str = "127.0.0.1"):
        super().__init__(args, backend, role="critic", master_addr=master_addr)

    def init(self, with_ref: bool = False) -> int:
        args, backend = self.args, self.backend
        seed_everything(args.seed)
        self.hooks = {"custom_before_log_prob_hook_path": None, "custom_before_train_step_hook_path": None}
        resume_dir = critic_resume_dir(args.load, args.ckpt_step)
        backend.build_critic(str(resume_dir) if resume_dir is not None else (args.critic_load or args.hf_checkpoint))
        if resume_dir is not None:
            return backend.load_training_state(resume_dir) + 1
        return args.start_rollout_id or 0

    @torch.no_grad()
    def compute_values(self, rollout_id: int, data: TrainData) -> list[torch.Tensor]:
        """Values (CPU, fp32) of every sample's response tokens under the current critic weights."""
        by_index = outputs_per_sample(self._schedule(data), self.backend.forward_only)
        return [by_index[i] for i in range(len(data["tokens"]))]

    def train(self, rollout_id: int, data: TrainData, values: list[torch.Tensor], returns: list[torch.Tensor]) -> dict:
        """Fit the values to `returns` (from the actor); `values` are this critic's own pre-update values."""
        if len(values) != len(data["tokens"]) or len(returns) != len(data["tokens"]):
            raise ValueError(f"critic got {len(values)} values and {len(returns)} returns for "
                             f"{len(data['tokens'])} samples")
        per_sample = dict(loss_masks=float_tensors(data["loss_masks"]),
                          old_values=values, returns=[r.float() for r in returns])
        step_metrics = [self._train_step(micro_batches, per_sample, self._value_loss)
                        for micro_batches in self._schedule(data)]
        return self._summarise(step_metrics, "critic/")

    def _value_loss(self, values, batch: MicroBatchTensors, reduce: LossReducer):
        return value_loss(self.args, values, batch, reduce)

    def save_model(self, rollout_id: int, run_state: dict | None = None) -> str:
        if not self.args.save:
            raise ValueError("save_model needs --save (the checkpoint root folder)")
        with self.backend.resident():  # saved between its updates: offloaded with --offload-train
            return self.backend.save_checkpoint(rollout_id, None, save_root=os.path.join(self.args.save, CRITIC_SUBDIR))

    def update_weights(self, *args, **kwargs) -> NoReturn:
        raise ValueError("the critic has no weights to push to the rollout engines; push the actor's")
