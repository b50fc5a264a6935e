"""The engine's KV cache as memory: how many blocks fit (`num_blocks_from_memory`), the bytes of one block, and the
storage of every layer's K and V (for multi-head latent attention one latent row per token, `cache_row_shape`; and,
for MoE models that record routing, the routed experts of every cache slot) in one StableBuffers, so a colocated
run's free and re-allocation on every hand-over puts the cache back at the same address (device_arena.py) and the
decode CUDA graphs that bake it in stay valid.

Not here: which slots a sequence owns (block_manager.py), binding the views to the attention layers
(model_runner.py), or reading and writing the cache (layers/attention.py).
"""

from __future__ import annotations

import os

import torch

from slime.engine.config import Config
from slime.engine.device_arena import StableBuffers
from slime.engine.models import ModelConfig

CPU_KV_CACHE_RAM_FRACTION = 0.25


def cache_row_shape(model_config: ModelConfig, num_kv_heads: int | None = None) -> tuple[int, int, int]:
    """(planes, heads, values per head) of one token's cache row in one layer on one rank: K and V planes of the
    `num_kv_heads` heads the rank stores (default: all), or for multi-head latent attention one plane of one latent
    "head" (kv_lora_rank + qk_rope_head_dim values, V being its first kv_lora_rank columns), never expanded per
    attention head."""
    if model_config.mla is not None:
        return 1, 1, model_config.mla.latent_dim
    return 2, model_config.num_key_value_heads if num_kv_heads is None else num_kv_heads, model_config.head_dim


def bytes_per_block(config: Config, model_config: ModelConfig, kv_dtype: torch.dtype,
                    num_kv_heads: int | None = None) -> int:
    """One block's bytes on one rank: `num_kv_heads` is the K/V heads that rank stores (default: all of them, the
    single-device engine; a rank of a sharded engine stores its share, engine/parallel/state.head_shard)."""
    c = model_config
    num_kv_heads = c.num_key_value_heads if num_kv_heads is None else num_kv_heads
    element_size = torch.empty((), dtype=kv_dtype).element_size()
    num_planes, num_heads, head_dim = cache_row_shape(c, num_kv_heads)
    kv_bytes = num_planes * c.num_hidden_layers * config.kvcache_block_size * num_heads * head_dim * element_size
    routing_bytes = len(c.moe_layers) * c.num_experts_per_tok * 4 * config.kvcache_block_size
    return kv_bytes + (routing_bytes if config.enable_return_routed_experts else 0)


def num_blocks_from_memory(config: Config, model_config: ModelConfig, device: torch.device, block_bytes: int) -> int:
    """The blocks that fit in gpu_memory_utilization of the device less what is in use (on the CPU, of the RAM,
    capped at CPU_KV_CACHE_RAM_FRACTION), and no more than max_num_seqs sequences of max_model_len need."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = total * config.gpu_memory_utilization - (total - free)
    else:
        total_ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        budget = total_ram * min(config.gpu_memory_utilization, CPU_KV_CACHE_RAM_FRACTION)
    max_model_len = config.max_model_len or model_config.max_position_embeddings
    wanted = config.max_num_seqs * -(-max_model_len // config.kvcache_block_size)
    num_blocks = min(wanted, int(budget // block_bytes))
    if num_blocks < 1:
        raise ValueError(f"gpu_memory_utilization={config.gpu_memory_utilization} leaves no memory for the KV "
                         "cache after the weights: raise it (slime: --sglang-mem-fraction-static), set "
                         "num_kvcache_blocks, or spread the model over more devices (--tp-size; slime: "
                         "--rollout-num-gpus-per-engine)")
    return num_blocks


class KVCacheStorage:
    """[num_layers, num_planes, num_slots // block_size, block_size, kv_heads, head_dim] K/V (2 planes; MLA's
    latent: 1) and, when `num_moe_layers` and `top_k` are given, [num_slots, num_moe_layers, top_k] int32 routed
    experts (-1: none recorded)."""

    def __init__(self, device: torch.device, num_layers: int, block_shape: tuple[int, ...], kv_dtype: torch.dtype,
                 routing_shape: tuple[int, int] | None = None, num_planes: int = 2):
        num_blocks, block_size = block_shape[:2]
        specs = [((num_layers, num_planes, *block_shape), kv_dtype)]
        if routing_shape is not None:
            specs.append(((num_blocks * block_size, *routing_shape), torch.int32))
        self.buffers = StableBuffers(device, specs)

    def allocate(self, zeroed: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The K/V cache (uninitialized unless `zeroed`) and the routed-experts record (or None)."""
        cache, *routing = self.buffers.allocate()
        if zeroed:
            cache.zero_()
        return cache, (routing[0].fill_(-1) if routing else None)

    @property
    def stable(self) -> bool:
        """Whether an allocation after a free puts the cache back at the same address."""
        return self.buffers.stable

    def free(self) -> None:
        self.buffers.free()
