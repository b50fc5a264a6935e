"""FSDPCritic: one training process of the PPO critic, a value model trained by its own train group.

Per rollout (spec 3.2e / 4.5): `compute_values` (forward only, these are the "old" values) goes to the actor, which
computes the GAE advantages and returns; `train` then fits the values to those returns with the clipped value loss
over the same optimizer-step schedule and aggregation as the actor. Weights start from --critic-load or
--hf-checkpoint (value head at zero); checkpoints go to `{save}/critic/`, resumed from `{load}/critic/`.

Not here: the estimator math (ppo_utils / advantages.py) and the Ray hand-over (slime/ray/actor_group.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from slime.backends.fsdp_utils import checkpoint
from slime.backends.fsdp_utils.actor import FSDPTrainer
from slime.backends.fsdp_utils.data import float_tensors, outputs_per_sample
from slime.backends.fsdp_utils.loss import LossReducer, MicroBatchTensors, value_loss
from slime.backends.fsdp_utils.model import ShardOptions, attention_implementation, load_hf_model, read_hf_weights
from slime.backends.fsdp_utils.optimizer import build_optimizer
from slime.backends.fsdp_utils.value_model import VALUE_HEAD_KEY, build_value_model
from slime.utils.checkpoint_state import CRITIC_SUBDIR, critic_checkpoint
from slime.utils.misc import seed_everything


def critic_resume_dir(load: str | None) -> Path | None:
    """The critic checkpoint of the same rollout as the actor's under --load (`{save}/critic/rollout_{id}`), checked
    complete; None when --load holds no actor checkpoint to resume from."""
    actor_dir = checkpoint.resolve_load_dir(load)
    return None if actor_dir is None else critic_checkpoint(actor_dir)


class FSDPCritic(FSDPTrainer):
    def __init__(self, args, rank: int, world_size: int, master_addr: str, master_port: int, role: str = "critic"):
        super().__init__(args, rank, world_size, master_addr, master_port, role="critic")

    def init(self, with_ref: bool = False) -> int:
        args = self.args
        seed_everything(args.seed)
        self.hooks = {"custom_before_log_prob_hook_path": None, "custom_before_train_step_hook_path": None}
        resume_dir = critic_resume_dir(args.load)
        weights_path = str(resume_dir) if resume_dir is not None else (args.critic_load or args.hf_checkpoint)
        head = read_hf_weights(weights_path).get(VALUE_HEAD_KEY)
        hf_model = load_hf_model(weights_path, attention_implementation(self.device))
        self.hf_config = hf_model.config
        self.model = build_value_model(hf_model, self.mesh, ShardOptions.from_args(args, self.device),
                                       value_head_weight=head)
        self.model.train()
        self.optimizer, self.scheduler = build_optimizer(args, self.model.parameters(), lr=args.critic_lr)
        if resume_dir is not None:
            return checkpoint.load_training_state(resume_dir, self.model, self.optimizer, self.scheduler,
                                                  self.rank) + 1
        return getattr(args, "start_rollout_id", None) or 0

    @torch.no_grad()
    def compute_values(self, rollout_id: int, data: dict) -> list[torch.Tensor]:
        """Values (CPU, fp32) of every sample's response tokens under the current critic weights."""
        self.model.eval()
        by_index = outputs_per_sample(self._schedule(data), self.model.forward_micro_batch, self.device)
        self.model.train()
        return [by_index[i] for i in range(len(data["tokens"]))]

    def train(self, rollout_id: int, data: dict, values: list[torch.Tensor], returns: list[torch.Tensor]) -> dict:
        """Fit the values to `returns` (from the actor); `values` are this critic's own pre-update values."""
        if len(values) != len(data["tokens"]) or len(returns) != len(data["tokens"]):
            raise ValueError(f"critic got {len(values)} values and {len(returns)} returns for "
                             f"{len(data['tokens'])} samples")
        per_sample = dict(loss_masks=float_tensors(data["loss_masks"]),
                          old_values=values, returns=[r.float() for r in returns])
        step_metrics = [self._train_step(micro_batches, per_sample, self._value_loss)
                        for micro_batches in self._schedule(data)]
        return self._summarise(step_metrics, "critic/")

    def _value_loss(self, micro_batch, batch: MicroBatchTensors, reduce: LossReducer):
        values = self.model.forward_micro_batch(micro_batch.to(self.device))
        return value_loss(self.args, values, batch, reduce)

    def save_model(self, rollout_id: int, run_state: dict | None = None) -> str:
        if not self.args.save:
            raise ValueError("save_model needs --save (the checkpoint root folder)")
        path = checkpoint.save_checkpoint(
            os.path.join(self.args.save, CRITIC_SUBDIR), rollout_id, self.model, self.optimizer, self.scheduler,
            hf_checkpoint=self.args.hf_checkpoint, rank=self.rank, save_optim=not self.args.no_save_optim,
            tie_word_embeddings=False, run_state=None,
        )
        return str(path)

    def update_weights(self, *args, **kwargs) -> dict:
        raise ValueError("the critic has no weights to push to the rollout engines; push the actor's")
