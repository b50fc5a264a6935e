"""MegatronBackend: the megatron-core training backend (TrainBackend over a `GPTModel` with tensor, pipeline and
expert parallelism).

Ranks: tensor / pipeline peers of one model replica receive the same samples (the flow and the Ray data split
see only the data-parallel rank and size); each data-parallel replica gets its slice. The loss a micro-batch
returns is its share of the global loss, so gradients are summed over data parallelism (grads.py). Outputs of the
forward live on the last pipeline stage and are broadcast to the others (micro_batches.py).

Optimizer: megatron-core's distributed optimizer over DDP grad buffers (optimizer.py) for this rank's trainable
parameters (the freezing flags leave some out: param_freeze.py, by megatron-core names), its state sharded as the
parameters are (over TP / PP / EP) and over data parallelism, with the FSDP backend's learning-rate schedule so
both backends step identically; StatelessAdam's update with --use-stateless-adam.

Virtual pipeline stages (--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank): each
rank holds one model chunk per virtual stage (model.py), run by megatron's interleaved 1F1B schedule, whose groups
of micro-batches make every step's count a multiple of the pipeline size (`num_micro_batches_multiple`); DDP wraps
each chunk and one distributed optimizer spans them; weights and checkpoints name layers by their global numbers.

MoE: experts split over --expert-model-parallel-size ranks (data-parallel ranks of the dense weights; megatron-core's
alltoall dispatcher moves each token to its experts' rank); the routers consult routing replay (moe_router.py) and
add the router losses (router_losses.py).

Checkpoints: torch_dist in Megatron-LM's folder layout (checkpoint.py), and with --save-hf also an HF folder; weights for the engines: HF-named full tensors gathered to rank 0
(hf_weights.py), sent by the shared WeightSender.

The PPO critic (`build_critic`): the same GPTModel, untied, with the value head of value_head.py as its output
layer, trained at --critic-lr by the same optimizer; its checkpoints are torch_dist under `{save}/critic/` (Megatron-LM's layout too).

Not here: the RL flows (slime/backends/train_flow.py, critic_flow.py).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from slime.backends.backend import LossOf, TrainBackend, reset_adam_state
from slime.backends.checkpoint_files import resolve_load_dir
from slime.backends.lora_adapter import (
    ADAPTER_SUBDIR,
    adapted_layers,
    adapters_disabled_in,
    load_peft_folder,
    lora_scale,
    merge_adapter_into,
    peft_config,
    save_peft_folder,
)
from slime.backends.megatron_utils import checkpoint
from slime.backends.megatron_utils.cpu_shim import apply_cpu_shim
from slime.backends.megatron_utils.grads import finalize_grads
from slime.backends.megatron_utils.hf_config import load_hf_config
from slime.backends.megatron_utils.hf_weights import load_hf_weights, model_hf_weights, save_hf_checkpoint
from slime.backends.megatron_utils.lora import adapter_to_hf, apply_lora, load_adapter_from_hf
from slime.backends.megatron_utils.micro_batches import run_micro_batches
from slime.backends.megatron_utils.model import build_model_chunks
from slime.backends.megatron_utils.moe_router import install_routers
from slime.backends.megatron_utils.names import named_global_parameters
from slime.backends.megatron_utils.offload import StorageOffload
from slime.backends.megatron_utils.optimizer import build_distributed_optimizer, clip_grad_norm, wrap_data_parallel
from slime.backends.megatron_utils.parallel import init_model_parallel
from slime.backends.megatron_utils.router_losses import install_router_losses
from slime.backends.megatron_utils.true_on_policy import tile_forward
from slime.backends.megatron_utils.value_head import OUTPUT_LAYER_KEY, has_value_head, hf_value_head, micro_batch_values
from slime.backends.packing import PackedMicroBatch
from slime.backends.param_freeze import freeze_parameters
from slime.backends.process_group import init_default_group, training_device
from slime.backends.true_on_policy import true_on_policy_spec


class MegatronBackend(TrainBackend):
    def __init__(self, args, rank: int, world_size: int, master_addr: str, master_port: int):
        from megatron.core import parallel_state

        self.args, self.rank, self.world_size = args, rank, world_size
        self.device = training_device(args, rank)
        if self.device.type == "cpu":
            apply_cpu_shim()
        init_default_group(self.device, rank, world_size, master_addr, master_port)
        init_model_parallel(args, self.device)
        # The flow's data-parallel reductions (loss denominators, metrics) run over the replicas; the context-
        # parallel ranks of one replica hold the same samples (DDP sums the gradients over data x context).
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.dp_group = parallel_state.get_data_parallel_group()
        if args.virtual_pipeline_model_parallel_size:  # the interleaved schedule's groups of micro-batches
            self.num_micro_batches_multiple = args.pipeline_model_parallel_size
        self.model_chunks, self.ddp_chunks = [], []
        self.model = self.optimizer = self.scheduler = self.hf_config = self.router_losses = None
        self.critic = False  # build_critic: the model ends in a value head
        self.tile_forward = None  # --true-on-policy-mode's forward (true_on_policy.py), set by build_policy
        self._offload = StorageOffload()

    # ----------------------------------------------------------------------------------------- building
    def build_policy(self, weights_path: str) -> None:
        args = self.args
        self.hf_config = load_hf_config(args.hf_checkpoint)
        self.model_chunks = build_model_chunks(args, self.hf_config, self.device)
        self.model = self.model_chunks[0]
        self.routing_replay = install_routers(self.model_chunks, self.hf_config)
        self.router_losses = install_router_losses(args, self.model_chunks)
        if args.lora_rank > 0:  # adapters beside the targeted linears, base frozen (lora.py)
            apply_lora(self.model_chunks, args.lora_target_modules, args.lora_rank, args.lora_alpha,
                       args.lora_dropout, args.seed)
        self._load_weights(weights_path)  # a torch_dist checkpoint holds the adapters too
        if args.lora_rank > 0 and not checkpoint.is_torch_dist_checkpoint(weights_path) and args.lora_adapter_path:
            load_adapter_from_hf(self.model_chunks, self.hf_config, load_peft_folder(args.lora_adapter_path)[1],
                                 args.lora_adapter_path)
        freeze_parameters(args, named_global_parameters(self.model_chunks), self._sum_over_ranks)
        self.ddp_chunks = wrap_data_parallel(self.model_chunks)
        self.optimizer, self.scheduler = build_distributed_optimizer(args, self.ddp_chunks,
                                                                     self.model.config.params_dtype)
        spec = true_on_policy_spec(args, args.hf_checkpoint, self.device)  # --true-on-policy-mode: the batch-invariant decoder
        if spec is not None:
            self.tile_forward = partial(tile_forward, spec=spec, hf_config=self.hf_config,
                                        temperature=args.rollout_temperature, device=self.device)

    def build_critic(self, weights_path: str) -> None:
        """The critic's GPTModel (value_head.py) from an HF folder, a critic checkpoint, or a policy checkpoint of
        this backend (its body; the head starts at zero), at --critic-lr; no routing replay (slime has none for
        the critic either)."""

        args = self.args
        self.critic = True
        self.hf_config = load_hf_config(args.hf_checkpoint)
        self.model_chunks = build_model_chunks(args, self.hf_config, self.device, critic=True)
        self.model = self.model_chunks[0]
        self.router_losses = install_router_losses(args, self.model_chunks)
        if not checkpoint.is_torch_dist_checkpoint(weights_path):
            head = hf_value_head(weights_path, self.hf_config.hidden_size)
            load_hf_weights(self.model_chunks, weights_path, self.hf_config, given={OUTPUT_LAYER_KEY: head})
        elif has_value_head(checkpoint.checkpoint_folder(weights_path)):
            checkpoint.load_model_weights(weights_path, self.model_chunks)
        else:
            checkpoint.load_model_weights(weights_path, self.model_chunks, skip=(OUTPUT_LAYER_KEY,))
        self.ddp_chunks = wrap_data_parallel(self.model_chunks)
        self.optimizer, self.scheduler = build_distributed_optimizer(args, self.ddp_chunks,
                                                                     self.model.config.params_dtype,
                                                                     lr=args.critic_lr)

    def _sum_over_ranks(self, counts: list[int]) -> list[int]:
        total = torch.tensor(counts, dtype=torch.int64, device=self.device)
        dist.all_reduce(total)
        return total.tolist()

    def _load_weights(self, path: str) -> None:
        if checkpoint.is_torch_dist_checkpoint(path):
            checkpoint.load_model_weights(path, self.model_chunks)
        else:
            load_hf_weights(self.model_chunks, path, self.hf_config)

    def load_hf_weights(self, path: str) -> None:
        """--ref-load / --opd-teacher-load: an HF folder or a torch_dist checkpoint (this backend's, slime's)."""
        self.require_on_device("loading weights")
        self._load_weights(path)

    def resolve_load_dir(self, load: str | None) -> Path | None:
        folder = resolve_load_dir(load, self.args.ckpt_step)
        if folder is not None and not checkpoint.is_torch_dist_checkpoint(folder):
            raise ValueError(f"--load {load}: {folder} is not a Megatron torch_dist checkpoint; "
                             "convert an HF folder with tools/convert_hf_to_torch_dist.py, or pass it as "
                             "--hf-checkpoint")
        return folder

    def load_training_state(self, resume_dir: Path) -> int:
        self.require_on_device("loading a checkpoint")
        return checkpoint.load_training_state(resume_dir, self.model_chunks, self.optimizer, self.scheduler)

    def save_checkpoint(self, rollout_id: int, run_state: dict | None, save_root: str | None = None) -> str:
        args = self.args
        self.require_on_device("saving a checkpoint")
        path = checkpoint.save_checkpoint(save_root or args.save, rollout_id, self.model_chunks, self.optimizer,
                                          self.scheduler, save_optim=not args.no_save_optim, run_state=run_state,
                                          args=args, hf_config=self.hf_config)
        lora = args.lora_rank > 0 and not self.critic
        adapter = self.adapter_weights() if lora else None
        if lora and self.rank == 0:  # the adapter in PEFT's format beside the torch_dist state (which resumes)
            save_peft_folder(Path(path) / ADAPTER_SUBDIR, peft_config(args, adapted_layers(adapter)), adapter)
        if args.save_hf and not self.critic:  # slime's template: the rollout id fills {rollout_id}
            merged = None
            if lora:  # the merged model: W + scale * B A per adapted layer (the router biases included)
                merged = merge_adapter_into(model_hf_weights(self.model_chunks, self.hf_config, buffers=True),
                                            adapter, lora_scale(args))
            save_hf_checkpoint(self.model_chunks, self.hf_config, args.save_hf.format(rollout_id=rollout_id),
                               args.hf_checkpoint, named_weights=merged)
        return str(path)

    # ---------------------------------------------------------------------------------------- compute
    def _run(self, micro_batches, loss_of=None):
        return run_micro_batches(self.model_chunks, micro_batches, temperature=self.args.rollout_temperature,
                                 vocab_size=self.hf_config.vocab_size, device=self.device,
                                 chunk_size=self.args.log_probs_chunk_size, loss_of=loss_of,
                                 routing_replay=self.routing_replay, router_losses=self.router_losses,
                                 head=micro_batch_values if self.critic else None, tile_forward=self.tile_forward)

    @torch.no_grad()
    def forward_only(self, micro_batches: list[PackedMicroBatch]) -> list:
        self.require_on_device("a forward pass")
        try:
            return self._run(micro_batches)
        finally:
            for chunk in self.model_chunks:
                chunk.train()

    def forward_backward(self, micro_batches: list[PackedMicroBatch], loss_of: LossOf) -> list[dict]:
        self.require_on_device("a train step")
        if self.router_losses is not None:
            self.router_losses.start(len(micro_batches), self.dp_size)
        metrics = self._run(micro_batches, loss_of)
        if self.router_losses is not None:
            metrics.append(self.router_losses.finish(self.dp_size))  # shares, as the per-micro-batch metrics
        finalize_grads(self.model_chunks, self.ddp_chunks)
        return metrics

    def clip_grad_norm(self, max_grad_norm: float) -> float:
        self.optimizer.prepare_grads()  # this rank's slice of the grad buffer to its main params' .grad
        return clip_grad_norm(self.optimizer, max_grad_norm)

    def apply_clipped_grads(self) -> None:
        self.optimizer.step_with_ready_grads()  # the slices' update, all-gathered into the parameters

    def reset_optimizer_states(self) -> None:
        for inner in self.optimizer.chained_optimizers:  # the torch optimizers over this rank's slices
            reset_adam_state(inner.optimizer)

    def zero_grad(self) -> None:
        for ddp_chunk in self.ddp_chunks:
            ddp_chunk.zero_grad_buffer()
        self.optimizer.zero_grad(set_to_none=True)

    # ---------------------------------------------------------------------------------------- weights
    def local_weights(self):
        self.require_on_device("reading the weights")
        for index, chunk in enumerate(self.model_chunks):
            for name, param in chunk.named_parameters():
                yield f"{index}.{name}", param

    def hf_weights(self, dtype: torch.dtype | None):
        """With LoRA: the base weights with the adapters merged in (for engines that load whole weights)."""
        self.require_on_device("gathering the weights")
        if self.args.lora_rank > 0 and not self.critic:
            adapter = self.adapter_weights()  # collective: before the generator's first gather
            return merge_adapter_into(model_hf_weights(self.model_chunks, self.hf_config, dtype), adapter,
                                      lora_scale(self.args))
        return model_hf_weights(self.model_chunks, self.hf_config, dtype)

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        """Collective over all ranks: the full adapter under HF names on every rank (each pipeline stage's, gathered
        over its tensor-parallel group, from the first data-parallel replica)."""
        from megatron.core import parallel_state

        self.require_on_device("gathering the adapter")
        stage = adapter_to_hf(self.model_chunks, self.hf_config)
        sender = (parallel_state.get_tensor_model_parallel_rank() == 0
                  and parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
                  and parallel_state.get_expert_data_parallel_rank() == 0)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, stage if sender else {})
        return {name: tensor for part in gathered for name, tensor in part.items()}

    def adapters_disabled(self):
        return adapters_disabled_in(self.model_chunks)

    def num_trainable_parameters(self) -> int:
        """Summed over every rank: a tensor-parallel shard counts on the first data-parallel replica, a replicated
        tensor there on tensor-parallel rank 0 only (each pipeline stage counts its own layers)."""
        from megatron.core import parallel_state

        first_replica = parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        count = sum(param.numel() for chunk in self.model_chunks for param in chunk.parameters()
                    if param.requires_grad and first_replica
                    and (getattr(param, "tensor_model_parallel", False) or tp_rank == 0))
        total = torch.tensor([count], dtype=torch.int64, device=self.device)
        dist.all_reduce(total)
        return int(total)

    # ---------------------------------------------------------------------------------------- memory
    def _buffers(self):
        return [buffer for chunk in self.ddp_chunks for buffer in chunk.buffers + chunk.expert_parallel_buffers]

    def _optimizer_tensors(self) -> list[torch.Tensor]:
        """The optimizer's main weights (fp32 copies with bf16 parameters, else views of the parameter buffer) and
        its state, over every chained optimizer."""
        tensors = []
        for inner in self.optimizer.chained_optimizers:
            tensors += [param for group in inner.optimizer.param_groups for param in group["params"]]
            tensors += [value for state in inner.optimizer.state.values() for value in state.values()
                        if isinstance(value, torch.Tensor)]
        return [tensor for tensor in tensors if tensor.device.type == "cuda"]

    def offload(self) -> None:
        """Colocated GPU runs: the parameter buffers, main weights and optimizer state to pinned host memory and the
        gradient buffers freed while the engines generate, storage by storage (offload.py says why not megatron's
        own `offload_to_cpu`)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            buffers = self._buffers()
            self._offload.offload(keep=[buffer.param_data for buffer in buffers] + self._optimizer_tensors(),
                                  drop=[buffer.grad_data for buffer in buffers if buffer.grad_data is not None])
            torch.cuda.empty_cache()

    def onload(self) -> None:
        if self.device.type == "cuda":
            self._offload.onload()

    @property
    def offloaded(self) -> bool:
        return self._offload.offloaded
