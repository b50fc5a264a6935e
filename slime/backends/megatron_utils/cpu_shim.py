"""Make megatron-core run on a CPU (gloo, fp32): the CPU tests and CI train with it.

megatron-core 0.16.1 assumes CUDA in three places of the model's forward and backward (slime-spec §13):
- `RotaryEmbedding.get_emb` moves `inv_freq` to `torch.cuda.current_device()` at the first forward;
- `transformer.utils.get_default_causal_mask` (also imported by name into `fusions.fused_softmax`) allocates on
  "cuda";
- `tensor_parallel.random.CudaRNGStatesTracker.fork` swaps the CUDA RNG state around dropout and initialisation
  (here a null context: the CPU runs use no dropout and initialise weights with `use_cpu_initialization`), and
  activation recompute (`CheckpointFunction`) saves and restores the CUDA RNG state (here nothing: it saves the
  CPU generator's too, the only one).
More appear past the plain forward and backward; the modules involved get a `torch` whose CUDA device is the CPU
(`_CpuDeviceTorch`; every other attribute is torch's own):
- the pipeline schedules (`get_forward_backward_func`, also at PP=1) and p2p communication allocate token counters
  and shape messages with `device="cuda"` / `torch.cuda.current_device()`;
- dist_checkpointing's saver synchronises CUDA before writing and reduces its success flags on "cuda";
- the MoE router moves its weight to `torch.cuda.current_device()` at its first forward;
- the distributed optimizer's stack: DDP's grad and param buffers, the optimizer's flags and gathers, the grad
  norm and its local multi-tensor fallback (`megatron.core.utils`, as Apex and Transformer Engine are absent);
- the tensor-parallel mappings (the expert-parallel token dispatch gathers through them), the sequence-parallel
  linear layers and megatron-core's global memory buffer (`core.utils`) allocate on `torch.cuda.current_device()`.
And one question is answered as for CUDA: the distributed optimizer sorts its parameters by `Tensor.type()`, and
the gradient clipping asserts it, accepting only 'torch.cuda.*Tensor' names; while they do, a CPU tensor's type
reads as its CUDA twin's.
And two are replaced: with PP > 1 and tied embeddings `LanguageModule.setup_embeddings_and_output_layer` moves the
last stage's copy of the embedding to CUDA before the all-reduce that makes both copies equal (here the all-reduce
runs on the CPU); the alltoall MoE token dispatcher creates a CUDA stream for its device-to-host copies of the
routing counts (on the CPU they are host tensors already: no stream, no copy; the split sizes become the numpy
arrays its all-to-alls take).

`apply_cpu_shim()` is applied explicitly by the backend when its device is the CPU, not at import: importing this
package must not change megatron-core for a process that trains on a GPU.

Not a device abstraction: anything else that needs CUDA (Transformer Engine, fused kernels) stays unsupported on
the CPU, and the backend does not ask for it there.
"""

from __future__ import annotations

import contextlib

import torch

_applied = False


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


class _CpuCuda:
    """`torch.cuda` as the schedules use it, with the CPU as the current device."""

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def synchronize(device=None) -> None:
        return None

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


def _on_cpu(function):
    def wrapped(*args, device=None, **kwargs):
        if device is not None and torch.device(device).type == "cuda":
            device = "cpu"
        return function(*args, device=device, **kwargs)

    return wrapped


class _CpuDeviceTorch:
    """torch, as seen by the pipeline schedules and p2p communication on the CPU: allocations on "cuda" land on the
    CPU. Only the names those modules call are wrapped; the rest are torch's."""

    cuda = _CpuCuda()
    zeros = staticmethod(_on_cpu(torch.zeros))
    empty = staticmethod(_on_cpu(torch.empty))
    ones = staticmethod(_on_cpu(torch.ones))
    tensor = staticmethod(_on_cpu(torch.tensor))

    def __getattr__(self, name):
        return getattr(torch, name)


def cpu_device_torch():
    """A `torch` whose CUDA device is the CPU, for another megatron-core module's `torch` (mla_local_spec.py)."""
    return _CpuDeviceTorch()


@contextlib.contextmanager
def _cuda_type_names():
    """`Tensor.type()` (no arguments) of a CPU tensor reads 'torch.cuda.FloatTensor' for 'torch.FloatTensor'."""
    original = torch.Tensor.type

    def type_as_on_cuda(self, *args, **kwargs):
        name = original(self, *args, **kwargs)
        if args or kwargs or self.is_cuda:
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = type_as_on_cuda
    try:
        yield
    finally:
        torch.Tensor.type = original


def _with_cuda_type_names(function):
    def wrapped(*args, **kwargs):
        with _cuda_type_names():
            return function(*args, **kwargs)

    return wrapped


class _UninitializedDistributed:
    @staticmethod
    def is_initialized() -> bool:
        return False

    def __getattr__(self, name):
        return getattr(torch.distributed, name)


class _TorchWithoutDistributed:
    distributed = _UninitializedDistributed()

    def __getattr__(self, name):
        return getattr(torch, name)


def _cpu_setup_embeddings(language_module, original):
    """The original with torch.distributed looking uninitialised (skips its CUDA move and all-reduce), then the
    all-reduce on the CPU."""

    def setup_embeddings_and_output_layer(self) -> None:
        language_module.torch = _TorchWithoutDistributed()
        printed = getattr(language_module.LanguageModule, "embedding_warning_printed", False)
        language_module.LanguageModule.embedding_warning_printed = True  # the warning would be wrong here
        try:
            original(self)
        finally:
            language_module.torch = torch
            language_module.LanguageModule.embedding_warning_printed = printed
        if torch.distributed.is_initialized() and self.share_embeddings_and_output_weights \
                and self.config.pipeline_model_parallel_size > 1 and self._is_in_embd_group():
            torch.distributed.all_reduce(self.shared_embedding_or_output_weight().data, group=self.embd_group)

    return setup_embeddings_and_output_layer


def _host_split_sizes(dispatcher, point: str, tokens_per_expert=None):
    """The alltoall dispatcher's device-to-host step on the CPU: no copy and no stream, but the all-to-all split
    sizes as numpy arrays, the form its collectives take them in (as the CUDA path leaves them)."""
    if not dispatcher.drop_and_pad and point == dispatcher.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(dispatcher, name)
            if torch.is_tensor(value):
                setattr(dispatcher, name, value.numpy())
    return tokens_per_expert


def apply_cpu_shim() -> None:
    """Patch megatron-core's CUDA assumptions for a process that trains on the CPU; idempotent."""
    global _applied
    if _applied:
        return
    from megatron.core import utils as core_utils
    from megatron.core.dist_checkpointing.strategies import filesystem_async, state_dict_saver
    from megatron.core.distributed import distributed_data_parallel, param_and_grad_buffer
    from megatron.core.fusions import fused_softmax
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.common.language_module import language_module
    from megatron.core.optimizer import clip_grads, distrib_optimizer
    from megatron.core.optimizer import optimizer as megatron_optimizer
    from megatron.core.pipeline_parallel import p2p_communication, schedules
    from megatron.core.tensor_parallel import layers as tp_layers
    from megatron.core.tensor_parallel import mappings
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer import utils as transformer_utils
    from megatron.core.transformer.moe import router
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    def get_emb_on_cpu(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        # RotaryEmbedding.get_emb without its move of inv_freq to the current CUDA device.
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if self.rotary_interleaved:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, None, None, :]

    RotaryEmbedding.get_emb = get_emb_on_cpu
    transformer_utils.get_default_causal_mask = _cpu_causal_mask
    fused_softmax.get_default_causal_mask = _cpu_causal_mask
    tp_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    tp_random._get_cuda_rng_state = lambda *args, **kwargs: None
    tp_random._set_cuda_rng_state = lambda *args, **kwargs: None
    for module in (schedules, p2p_communication, router, filesystem_async, state_dict_saver, param_and_grad_buffer,
                   distributed_data_parallel, distrib_optimizer, megatron_optimizer, clip_grads, core_utils, mappings,
                   tp_layers):
        module.torch = _CpuDeviceTorch()
    optimizer_class = distrib_optimizer.DistributedOptimizer
    optimizer_class._build_model_and_main_param_groups = staticmethod(
        _with_cuda_type_names(optimizer_class._build_model_and_main_param_groups))
    megatron_optimizer.clip_grad_by_total_norm_fp32 = _with_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = "cpu: no stream"  # set, so no CUDA stream is created
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _host_split_sizes
    language_module.LanguageModule.setup_embeddings_and_output_layer = _cpu_setup_embeddings(
        language_module, language_module.LanguageModule.setup_embeddings_and_output_layer)
    _applied = True
