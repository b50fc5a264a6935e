"""FSDPBackend: the FSDP2 training backend (TrainBackend over a Hugging Face model sharded with `fully_shard`).

Every rank is a data-parallel rank: FSDP shards each parameter over all ranks and averages their gradients, so a
loss that is a rank's share of the global sum is scaled by the world size before its backward. MoE models: the
routers consult the routing replay object (moe_router.py) and the router losses (--moe-aux-loss-coeff,
--moe-z-loss-coeff) join each micro-batch's loss as its share of the step's mean. Checkpoints are HF
folders (checkpoint.py); the weights pushed to the engines are the gathered full parameters under their HF names.

The PPO critic (`build_critic`) is value_model.py's model trained at --critic-lr.

Not here: the RL flows (slime/backends/train_flow.py, critic_flow.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from slime.backends.backend import LossOf, TrainBackend
from slime.backends.checkpoint_files import VALUE_HEAD_KEY, resolve_load_dir
from slime.backends.fsdp_utils import checkpoint
from slime.backends.fsdp_utils.lora import apply_lora, load_start_adapter, select_adapters
from slime.backends.fsdp_utils.model import (
    ShardOptions,
    attention_implementation,
    build_policy_model,
    hf_name,
    iter_full_parameters,
    load_full_weights,
    load_hf_model,
    read_hf_weights,
    reshard,
)
from slime.backends.fsdp_utils.moe_router import install_routers
from slime.backends.fsdp_utils.offload import TrainingStateOffload
from slime.backends.fsdp_utils.optimizer import build_optimizer, clip_grad_norm
from slime.backends.fsdp_utils.value_model import build_value_model
from slime.backends.lora_adapter import (
    adapted_layers,
    adapters_disabled,
    is_lora_name,
    lora_scale,
    merged_hf_weights,
    save_adapters,
)
from slime.backends.moe_aux_loss import router_losses
from slime.backends.packing import PackedMicroBatch
from slime.backends.param_freeze import freeze_parameters
from slime.backends.process_group import init_default_group, training_device
from slime.backends.true_on_policy import true_on_policy_spec

logger = logging.getLogger(__name__)


class FSDPBackend(TrainBackend):
    hf_weights_on_every_rank = True  # DTensor.full_tensor() gathers each parameter to every rank
    def __init__(self, args, rank: int, world_size: int, master_addr: str, master_port: int):
        self.args, self.rank, self.world_size = args, rank, world_size
        self.device = training_device(args, rank)
        init_default_group(self.device, rank, world_size, master_addr, master_port)
        self.mesh = init_device_mesh(self.device.type, (world_size,))
        self.dp_rank, self.dp_size = rank, world_size
        self.training_state = TrainingStateOffload(self.device) if self.device.type == "cuda" else None
        self.model = self.optimizer = self.scheduler = self.hf_config = None
        self.router_trace = None

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer, for whatever reads or writes its state (the step, a reset, a checkpoint, a hook): first the
        compute stream waits for the state's copy in flight (offload.py), so no reader bypasses that wait."""
        self._optimizer_state_touched()
        return self._optimizer

    @optimizer.setter
    def optimizer(self, optimizer: torch.optim.Optimizer | None) -> None:
        self._optimizer = optimizer

    def _optimizer_state_touched(self) -> None:
        if self.training_state is not None:
            self.training_state.optimizer_state_touched()

    @property
    def offloaded(self) -> bool:
        return self.training_state is not None and self.training_state.offloaded


    # ----------------------------------------------------------------------------------------- building
    def build_policy(self, weights_path: str) -> None:
        args = self.args
        hf_model = load_hf_model(weights_path, attention_implementation())
        self.hf_config = hf_model.config
        self.routing_replay, self.router_trace = install_routers(hf_model, args.moe_router_dtype) or (None, None)
        if args.true_on_policy_mode:  # the tile layers route themselves (no trace; router losses are refused)
            self.router_trace = None
        freeze_parameters(args, hf_model.named_parameters())  # HF names; before sharding, which keeps the flags
        if args.lora_rank > 0:  # adapters on the targets, base frozen; their start values before sharding
            apply_lora(hf_model, args.lora_target_modules, args.lora_rank, args.lora_alpha, args.lora_dropout,
                       args.lora_adapter_names if args.lora_adapter_key else None)
            load_start_adapter(hf_model, args, weights_path)
        self.model = build_policy_model(hf_model, self.mesh, ShardOptions.from_args(args, self.device),
                                        temperature=args.rollout_temperature, chunk_size=args.log_probs_chunk_size,
                                        tile_spec=true_on_policy_spec(args, weights_path, self.device),
                                        routing_replay=self.routing_replay)
        self._finish_build(args.lr)

    def build_critic(self, weights_path: str) -> None:
        hf_model = load_hf_model(weights_path, attention_implementation())
        self.hf_config = hf_model.config
        self.model = build_value_model(hf_model, self.mesh, ShardOptions.from_args(self.args, self.device),
                                       value_head_weight=read_hf_weights(weights_path).get(VALUE_HEAD_KEY))
        self._finish_build(self.args.critic_lr)

    def _finish_build(self, lr: float) -> None:
        self.model.train()  # from_pretrained returns eval mode; HF activation checkpointing only runs in train mode
        self.optimizer, self.scheduler = build_optimizer(self.args, self.model.parameters(), lr=lr)

    def load_hf_weights(self, path: str) -> None:
        self.require_on_device("loading weights")
        load_full_weights(self.model, read_hf_weights(path))

    def resolve_load_dir(self, load: str | None) -> Path | None:
        return resolve_load_dir(load, self.args.ckpt_step)

    def load_training_state(self, resume_dir: Path) -> int:
        self.require_on_device("loading a checkpoint")
        return checkpoint.load_training_state(resume_dir, self.model, self.optimizer, self.scheduler, self.rank)

    def save_checkpoint(self, rollout_id: int, run_state: dict | None, save_root: str | None = None) -> str:
        args = self.args
        self.require_on_device("saving a checkpoint")
        path = checkpoint.save_checkpoint(
            save_root or args.save, rollout_id, self.model, self.optimizer, self.scheduler,
            hf_checkpoint=args.hf_checkpoint, rank=self.rank, save_optim=not args.no_save_optim,
            tie_word_embeddings=bool(getattr(self.hf_config, "tie_word_embeddings", False)), run_state=run_state,
            write_adapter=(lambda folder, adapter: save_adapters(folder, args, adapter))
            if args.lora_rank > 0 and save_root is None else None,
        )
        if args.save_hf and args.lora_rank > 0 and save_root is None:  # the merged model, loadable without PEFT
            merged = merged_hf_weights(iter_full_parameters(self.model), self.adapted_layers, lora_scale(args))
            checkpoint.save_hf_folder(args.save_hf.format(rollout_id=rollout_id), merged, args.hf_checkpoint,
                                      self.rank, bool(getattr(self.hf_config, "tie_word_embeddings", False)))
        return str(path)

    # ---------------------------------------------------------------------------------------- compute
    @torch.no_grad()
    def forward_only(self, micro_batches: list[PackedMicroBatch]) -> list:
        self.require_on_device("a forward pass")
        self.model.eval()
        try:
            outputs = []
            for micro_batch in micro_batches:
                micro_batch = micro_batch.to(self.device)
                with self.routing_of(micro_batch), select_adapters(self.model, micro_batch.token_adapters):
                    outputs.append(self.model.forward_micro_batch(micro_batch))
            return outputs
        finally:
            self.model.train()

    def forward_backward(self, micro_batches: list[PackedMicroBatch], loss_of: LossOf) -> list[dict]:
        self.require_on_device("a train step")
        metrics = []
        for index, micro_batch in enumerate(micro_batches):
            micro_batch = micro_batch.to(self.device)
            # the backward's recompute replays the same routing and the same per-token adapters
            with self.routing_of(micro_batch), select_adapters(self.model, micro_batch.token_adapters):
                if self.router_trace is not None:
                    self.router_trace.start()
                loss, loss_metrics = loss_of(index, self.model.forward_micro_batch(micro_batch))
                if self.router_trace is not None:
                    loss, loss_metrics = self._add_router_losses(loss, loss_metrics, micro_batches[index],
                                                                 len(micro_batches))
                # FSDP averages gradients over ranks; the loss is already a share of the global sum.
                (loss * self.world_size).backward()
            metrics.append(loss_metrics)
        return metrics

    def _add_router_losses(self, loss, loss_metrics: dict, micro_batch: PackedMicroBatch, num_micro_batches: int):
        """Router losses and load metric of one micro-batch as its share of the mean over the step's micro-batches
        and the ranks (the flow sums metric shares over both)."""
        layers = self.router_trace.stop()
        sample_lengths = micro_batch.cu_seqlens.diff().tolist()  # the host copy: no device sync
        extra, router_metrics = router_losses(self.args, layers, self.routing_replay.num_experts, sample_lengths)
        share = 1.0 / (num_micro_batches * self.world_size)
        if extra is not None:
            loss = loss + extra * share
        return loss, {**loss_metrics, **{key: value * share for key, value in router_metrics.items()}}

    def clip_grad_norm(self, max_grad_norm: float) -> float:
        """Several LoRA adapters: each clipped on its own norm (one adapter's large gradient does not shrink another's
        step); returns the norm over all of them."""
        if not self.args.lora_adapter_key:
            return float(clip_grad_norm(self.model.parameters(), max_grad_norm))
        squares = 0.0
        for name in self.args.lora_adapter_names:
            params = [param for key, param in self.model.named_parameters()
                      if f".lora_A.{name}." in key or f".lora_B.{name}." in key]
            squares += float(clip_grad_norm(params, max_grad_norm)) ** 2
        return squares ** 0.5

    # ---------------------------------------------------------------------------------------- weights
    def local_weights(self):
        self.require_on_device("reading the weights")
        reshard(self.model)  # the root stays unsharded after a forward: its parameters must be the shards
        for name, param in self.model.named_parameters():
            yield name, (param.to_local() if isinstance(param, DTensor) else param)

    def hf_weights(self, dtype: torch.dtype | None):
        """With LoRA: the base weights with the adapters merged in (for engines that load whole weights)."""
        self.require_on_device("gathering the weights")
        if self.args.lora_rank > 0:
            return merged_hf_weights(iter_full_parameters(self.model, dtype), self.adapted_layers,
                                     lora_scale(self.args))
        return iter_full_parameters(self.model, dtype)

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        """Collective: the full LoRA adapter {HF name: tensor} (fp32, on the CPU) on every rank."""
        self.require_on_device("gathering the adapter")
        reshard(self.model)
        return {hf_name(name): (param.full_tensor() if isinstance(param, DTensor) else param).detach().cpu().clone()
                for name, param in self.model.named_parameters() if is_lora_name(name)}

    def num_trainable_parameters(self) -> int:
        """A DTensor's numel is its full tensor's: no reduction needed."""
        return sum(param.numel() for param in self.model.parameters() if param.requires_grad)

    @property
    def adapted_layers(self) -> set[str]:
        return adapted_layers(hf_name(name) for name, _ in self.model.named_parameters())

    def adapters_disabled(self):
        return adapters_disabled(self.model)

    # ---------------------------------------------------------------------------------------- memory
    def prepare_offload(self) -> None:
        if self.training_state is not None:
            self.training_state.to_host_early(self.model, self._optimizer)

    def offload(self) -> None:
        if self.training_state is not None:
            self.training_state.offload(self.model, self._optimizer)

    def onload(self) -> None:
        if self.training_state is not None:
            self.training_state.onload(self.model, self._optimizer)
