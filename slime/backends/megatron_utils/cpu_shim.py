"""Make megatron-core's forward and backward run on a CPU (gloo, fp32): the CPU tests and CI use it.

megatron-core 0.16.1 assumes CUDA in three places on the training path (slime-spec §13):
- `RotaryEmbedding.get_emb` moves `inv_freq` to `torch.cuda.current_device()` at the first forward;
- `transformer.utils.get_default_causal_mask` (also imported by name into `fusions.fused_softmax`) allocates on
  "cuda";
- `tensor_parallel.random.CudaRNGStatesTracker.fork` swaps the CUDA RNG state around dropout and initialisation.
`apply_cpu_shim()` replaces those three on the CPU only (the RNG fork becomes a null context: the CPU runs use no
dropout, and weights are initialised with `use_cpu_initialization` under the default generator). It is applied
explicitly by the backend before it builds a model, not at import: importing this package must not change
megatron-core for a GPU process that shares the interpreter. On a machine with CUDA it does nothing.

Not a device abstraction: anything else that needs CUDA (Transformer Engine, fused kernels) stays unsupported on
the CPU, and the backend does not ask for it there.
"""

from __future__ import annotations

import contextlib

import torch

_applied = False


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def apply_cpu_shim() -> bool:
    """Patch the three CUDA assumptions when CUDA is absent; idempotent. Returns whether the shim is active."""
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    from megatron.core.fusions import fused_softmax
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer import utils as transformer_utils

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
    _applied = True
    return True
