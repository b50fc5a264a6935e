"""megatron-core's distributed optimizer for the Megatron backend, as slime builds it: each model chunk wrapped in
megatron's `DistributedDataParallel` (contiguous grad buffers, `param.main_grad`; the parameters live in a
contiguous param buffer), and `get_megatron_optimizer` with `use_distributed_optimizer` (ZeRO-1: each
data-parallel rank holds the Adam moments, and on GPUs the fp32 main weights, of its 1/DP slice of the buffer;
gradients are reduce-scattered to the slices, the updated slices all-gathered back into the parameters).

The optimizer is megatron's Adam in AdamW mode (torch's AdamW when neither Transformer Engine nor Apex is
installed; slime's StatelessAdam over the same slices with --use-stateless-adam) with weight decay on every
trainable parameter (frozen ones get no grad buffer and no state), and the learning rate follows the project's
schedule (fsdp_utils/optimizer.py's `learning_rate`), so both backends take the same steps. megatron's
`OptimizerParamScheduler` is not used: its warmup starts from its init lr (0) at the first step and its decay
starts one step later than the project's, so the two backends would step differently.

Two fixes of megatron-core 0.16.1's optimizer load with torch's AdamW (neither Transformer Engine nor Apex, as on
the CPU machines and the H200 image), on every device: the 'fully_reshardable' load copies every per-parameter
state key of the live optimizer, torch's `step` included, from the checkpoint's tensors, which carry none (the
fixed copy takes the keys the checkpoint has); and it restores the step as one tensor shared by every parameter,
which torch's AdamW then increments once per parameter per step (each parameter gets its own copy).

On the CPU (gloo, fp32) the same code runs with cpu_shim.py's patches. Not the gradient bookkeeping before the
step (grads.py) and not the checkpoint layout (checkpoint.py).
"""

from __future__ import annotations

import torch

from slime.backends.lr_schedule import learning_rate, total_optimizer_steps, trainable_parameters
from slime.backends.stateless_adam import StatelessAdam


def wrap_data_parallel(model_chunks) -> list:
    """Each chunk in megatron's DDP (no overlap of communication with compute: the flow runs one backward per
    optimizer step's micro-batches, then syncs)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               overlap_param_gather=False, use_distributed_optimizer=True,
                                               check_for_nan_in_grad=False)
    return [DistributedDataParallel(chunk.config, ddp_config, chunk) for chunk in model_chunks]


def _set_main_param_and_optimizer_states(self, model_param, tensors) -> None:
    """DistributedOptimizer's method of that name (its non-precision-aware branch) for the keys of `tensors` only."""
    group_index, group_order = self.model_param_group_index_map[model_param]
    main_param = self.optimizer.param_groups[group_index]["params"][group_order]
    destinations = {"param": main_param, **self.optimizer.state[main_param]}
    for key, tensor in tensors.items():
        destinations[key].copy_(tensor)


def _with_own_steps(load_state_dict):
    def load_with_own_steps(self, state_dict) -> None:
        load_state_dict(self, state_dict)
        for state in self.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()

    return load_with_own_steps


def _fix_torch_adam_loading() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if DistributedOptimizer._set_main_param_and_optimizer_states is _set_main_param_and_optimizer_states:
        return
    DistributedOptimizer._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states
    DistributedOptimizer.load_state_dict = _with_own_steps(DistributedOptimizer.load_state_dict)


def build_distributed_optimizer(args, ddp_chunks, params_dtype: torch.dtype, lr: float | None = None):
    """megatron's (chained) distributed optimizer over the DDP chunks, and its learning-rate schedule, at `lr`
    (default --lr; the critic passes --critic-lr)."""
    lr = args.lr if lr is None else lr
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    _fix_torch_adam_loading()
    trainable_parameters(param for chunk in ddp_chunks for param in chunk.parameters())

    config = OptimizerConfig(optimizer="adam", lr=lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                             adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
                             clip_grad=args.clip_grad, use_distributed_optimizer=True,
                             bf16=params_dtype == torch.bfloat16, params_dtype=params_dtype)
    # No overrides: weight decay on every parameter, as the FSDP backend's AdamW (megatron's default skips biases
    # and norms).
    optimizer = get_megatron_optimizer(config, ddp_chunks, config_overrides={})
    if args.use_stateless_adam:
        for inner in optimizer.chained_optimizers:
            # megatron's param groups (this rank's slices: views of the buffers, which torch's constructor would
            # refuse as non-leaf tensors, so they are handed over as megatron itself does), stepped without state.
            stateless = StatelessAdam([{"params": []}], lr=lr, betas=(args.adam_beta1, args.adam_beta2),
                                      eps=args.adam_eps, weight_decay=args.weight_decay)
            stateless.param_groups = inner.optimizer.param_groups
            inner.optimizer = stateless
    return optimizer, LearningRateSchedule(args, optimizer, lr)


def clip_grad_norm(optimizer, max_norm: float) -> float:
    """The global gradient norm over every chained optimizer's slices (dense, and with expert parallelism the
    experts', each over its own group), and every slice clipped to `max_norm` (when > 0) by that one norm, as
    `ChainedOptimizer.step` does; its own `clip_grad_norm` serves a single optimizer only."""
    from megatron.core.optimizer import optimizer as megatron_optimizer

    grad_norm = optimizer.get_grad_norm()
    for inner in optimizer.chained_optimizers:
        parameters = inner.get_parameters()
        if max_norm > 0.0 and parameters:
            megatron_optimizer.clip_grad_by_total_norm_fp32(parameters, max_norm=max_norm, total_norm=grad_norm)
    return float(grad_norm)


class LearningRateSchedule:
    """Sets every param group's lr to the project's schedule at the current optimizer step; `step()` advances it.
    State: the step count (checkpoint.py saves it)."""

    def __init__(self, args, optimizer, lr: float):
        self.optimizer = optimizer
        self.schedule = dict(lr=lr, min_lr=args.min_lr, warmup_steps=args.lr_warmup_iters,
                             total_steps=total_optimizer_steps(args), decay_style=args.lr_decay_style)
        self.num_steps = 0
        self._apply()

    def _apply(self) -> None:
        lr = learning_rate(self.num_steps, **self.schedule)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self) -> None:
        self.num_steps += 1
        self._apply()

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state: dict) -> None:
        self.num_steps = state["num_steps"]
        self._apply()

